#include "estimate/reserved.h"

#include <algorithm>
#include <vector>

#include "memory/caching_policy.h"

namespace headroom {

ReservedReplay replay_reserved(const std::vector<sim::Memory::Event>& events, size_t step_begin, int steps,
                               const AllocatorConfig& config, std::optional<int64_t> limit) {
  CachingPolicy policy(config, limit);
  // Live buffers' addresses by buffer id (the ids count the simulation's buffers from 0).
  constexpr uint64_t kNone = UINT64_MAX;
  int ids = 0;
  for (const sim::Memory::Event& e : events) ids = std::max(ids, e.id + 1);
  std::vector<uint64_t> address(static_cast<size_t>(ids), kNone);
  ReservedReplay r;
  auto play = [&](size_t from, size_t to) {
    for (size_t i = from; i < to && !r.oom; ++i) {
      const sim::Memory::Event& e = events[i];
      uint64_t& at = address[static_cast<size_t>(e.id)];
      if (e.allocated) {
        // Zero-byte tensors take no block; a buffer the step keeps (not freed in it) is made once.
        if (e.bytes == 0 || at != kNone) continue;
        const auto a = policy.allocate(e.bytes);
        if (!a) {
          r.oom = true;
          break;
        }
        at = *a;
      } else if (at != kNone) {
        policy.free(at);
        at = kNone;
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
