#include "snapshot/allocator_replay.h"

#include <fmt/format.h>

#include <exception>
#include <future>
#include <unordered_map>

#include "memory/caching_policy.h"
#include "util/error.h"

namespace headroom::snapshot_analysis {
namespace {

ReplayOutcome replay(const std::deque<SnapshotEvent>& ev, const InitialBlocks& initial, bool use_completed,
                     const AllocatorConfig& config, int64_t device) {
  // A device large enough for the trace, which it never fills (the policy sizes the address space
  // of expandable segments from it): nothing is refused for want of memory.
  CachingPolicy p(config, device);
  std::unordered_map<uint64_t, uint64_t> where;
  std::unordered_map<int64_t, int> streams;
  auto stream = [&](int64_t s) { return streams.try_emplace(s, static_cast<int>(streams.size())).first->second; };
  for (const auto& [addr, b] : initial) {
    if (b.size <= 0) continue;
    if (const auto a = p.allocate(b.size, stream(b.stream))) where[addr] = *a;
  }
  ReplayOutcome out;
  bool freeing_segments = false;
  int64_t emptied = 0;  // each costs a walk of the cached blocks: a thousand at most
  for (size_t i = 0; i < ev.size(); ++i) {
    const SnapshotEvent& e = ev[i];
    if (e.action == SnapshotAction::alloc && e.size > 0) {
      if (const auto a = p.allocate(e.size, stream(e.stream))) where[e.address] = *a;
    } else if (is_free(e.action, use_completed)) {
      if (const auto it = where.find(e.address); it != where.end()) {
        p.free(it->second);
        where.erase(it);
      }
    } else if (e.action == SnapshotAction::segment_free || e.action == SnapshotAction::segment_unmap) {
      // The program (or an OOM's retry) released cached segments here: do the same once.
      if (!freeing_segments && ++emptied <= 1000) p.empty_cache();
      freeing_segments = true;
      continue;
    } else if (e.action == SnapshotAction::oom) {
      out.reserved_at[static_cast<int64_t>(i)] = p.stats().reserved_bytes.current;
    }
    freeing_segments = false;
  }
  out.peak_reserved = p.stats().reserved_bytes.peak;
  out.peak_allocated = p.stats().allocated_bytes.peak;
  return out;
}

}  // namespace

std::vector<ReplayConfig> replay_configs(const AllocatorSettings& settings) {
  AllocatorConfig recorded;
  std::string recorded_name = "as recorded";
  if (settings.known) {
    try {
      recorded = parse_allocator_config(settings.conf, "the snapshot's PYTORCH_CUDA_ALLOC_CONF");
    } catch (const Error&) {
      recorded = AllocatorConfig{};
    }
    recorded.expandable_segments = settings.expandable_segments;
    if (settings.max_split_size > 0) recorded.max_split_size = settings.max_split_size;
  }
  if (!recorded.text().empty()) recorded_name += " (" + recorded.text() + ")";
  std::vector<ReplayConfig> configs = {{recorded_name, recorded}};
  if (!recorded.expandable_segments) {
    AllocatorConfig c = recorded;
    c.expandable_segments = true;
    configs.push_back({"expandable_segments:True", c});
  }
  for (int64_t mb : {128, 512}) {
    if (recorded.expandable_segments || recorded.max_split_size == (mb << 20)) continue;
    AllocatorConfig c = recorded;
    c.max_split_size = mb << 20;
    configs.push_back({fmt::format("max_split_size_mb:{}", mb), c});
  }
  return configs;
}

std::vector<std::optional<ReplayOutcome>> run_replays(const std::deque<SnapshotEvent>& ev, const InitialBlocks& initial,
                                                      bool use_completed, const std::vector<ReplayConfig>& configs,
                                                      int64_t device) {
  std::vector<std::future<std::optional<ReplayOutcome>>> running;
  for (const ReplayConfig& c : configs) {
    running.push_back(std::async(std::launch::async, [&ev, &initial, use_completed, &c, device] {
      try {
        return std::optional<ReplayOutcome>(replay(ev, initial, use_completed, c.config, device));
      } catch (const std::exception&) {  // a trace the policy cannot follow (it checks its invariants)
        return std::optional<ReplayOutcome>();
      }
    }));
  }
  std::vector<std::optional<ReplayOutcome>> outcomes;
  for (auto& r : running) outcomes.push_back(r.get());
  return outcomes;
}

}  // namespace headroom::snapshot_analysis
