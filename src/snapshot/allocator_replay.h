// A device's trace replayed through the caching allocator's policy (memory/caching_policy.h), for the
// snapshot analysis's fragmentation lever: the settings to try (the snapshot's own, as recorded;
// expandable_segments:True unless they have it; max_split_size_mb:128 and :512 unless they have
// expandable segments or that size), and for each replay its peak reserved and allocated bytes and
// its reserved bytes at each OOM event. The blocks live when the trace began are allocated first;
// each alloc is served by the policy and its free (as the trace counts frees:
// snapshot/trace_accounting.h) returns the block; where the program released cached segments
// (segment_free or segment_unmap) the policy empties its cache, once per run of them and a thousand
// times at most. The device is taken as large enough for the trace: nothing is refused for want of
// memory. The replays are independent, one thread each; one that the policy cannot follow (blocks
// freed that it never handed out, or overlapping ones: it checks its invariants) has no outcome.
// Private to the snapshot analysis.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "memory/allocator_config.h"
#include "snapshot/memory_snapshot.h"
#include "snapshot/trace_accounting.h"

namespace headroom::snapshot_analysis {

struct ReplayConfig {
  std::string name;  // "as recorded (...)", "expandable_segments:True", "max_split_size_mb:128"
  AllocatorConfig config;
};

struct ReplayOutcome {
  int64_t peak_reserved = 0, peak_allocated = 0;
  std::map<int64_t, int64_t> reserved_at;  // oom event -> reserved
};

using InitialBlocks = std::vector<std::pair<uint64_t, LiveBlock>>;  // live when the trace began

// The settings to replay, the recorded ones first (a PYTORCH_CUDA_ALLOC_CONF that does not parse
// counts as the defaults, with the recorded expandable_segments and max_split_size).
std::vector<ReplayConfig> replay_configs(const AllocatorSettings& recorded);

// One replay per config, in its order, on a device of `device` bytes.
std::vector<std::optional<ReplayOutcome>> run_replays(const std::deque<SnapshotEvent>& ev, const InitialBlocks& initial,
                                                      bool use_completed, const std::vector<ReplayConfig>& configs,
                                                      int64_t device);

}  // namespace headroom::snapshot_analysis
