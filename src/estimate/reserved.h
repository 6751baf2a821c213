// Reserved memory before a run: the estimator's allocation sequence (sim::Memory::events) replayed
// through the caching allocator's policy (memory/caching_policy.h) — the same code that serves the
// cpu caching allocator, so a prediction and a measurement differ only where the sequences do.
//
// The setup (dataset, weights, optimizer state) is replayed once, then the step `steps` times: the
// second step starts from the cache the first left, as a real run's does. With a cap (a budget),
// the replay also says whether the run fits by reserved memory: a cached block the policy cannot
// reuse, or a segment it cannot free, fails a request that live bytes alone would allow. The
// events' ids number the buffers from 0, as sim::Memory does (the replay keeps one slot per id).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "estimate/sim.h"
#include "memory/allocator_config.h"

namespace headroom {

// With `oom`, the figures are up to the failure.
struct ReservedReplay {
  int64_t peak_reserved = 0;
  int64_t peak_allocated = 0;       // at block size (512-byte multiples and whole unsplit blocks)
  int64_t peak_inactive_split = 0;  // free bytes stranded inside split segments
  int64_t segments = 0;             // at the end
  bool oom = false;                 // with a cap: a request the policy could not serve
};

ReservedReplay replay_reserved(const std::vector<sim::Memory::Event>& events, size_t step_begin, int steps,
                               const AllocatorConfig& config, std::optional<int64_t> limit = std::nullopt);

}  // namespace headroom
