#include "estimate/reserved.h"

#include <unordered_map>

#include "memory/caching_policy.h"

namespace headroom {

ReservedReplay replay_reserved(const std::vector<sim::Memory::Event>& events, size_t step_begin, int steps,
                               const AllocatorConfig& config, std::optional<int64_t> limit) {
  CachingPolicy policy(config, limit);
  std::unordered_map<int, uint64_t> address;  // live buffers
  ReservedReplay r;
  auto play = [&](size_t from, size_t to) {
    for (size_t i = from; i < to && !r.oom; ++i) {
      const sim::Memory::Event& e = events[i];
      if (e.allocated) {
        // Zero-byte tensors take no block; a buffer the step keeps (not freed in it) is made once.
        if (e.bytes == 0 || address.count(e.id) != 0) continue;
        const auto a = policy.allocate(e.bytes);
        if (!a) {
          r.oom = true;
          break;
        }
        address[e.id] = *a;
      } else if (auto it = address.find(e.id); it != address.end()) {
        policy.free(it->second);
        address.erase(it);
      }
    }
  };
  play(0, step_begin);
  for (int s = 0; s < steps && !r.oom; ++s) play(step_begin, events.size());
  const CachingStats& st = policy.stats();
  r.peak_reserved = st.reserved_bytes.peak;
  r.peak_allocated = st.allocated_bytes.peak;
  r.peak_inactive_split = st.inactive_split_bytes.peak;
  r.segments = st.segment.current;
  return r;
}

}  // namespace headroom
