// Guard policy (after_step_oom) — what the OOM guard does when a step runs out of memory: the rules
// the trainer's OomGuard (train/oom_guard.h) and the Python module's guard share.
//
// Before the optimizer update, the step can run again from its start: with a caching allocator
// whose free split bytes could have held the request, the same micro-batch in expandable segments
// (memory/cache_policy.h); otherwise the same global batch with half the micro-batch (rounded up)
// and correspondingly more accumulation. It gives up when the guard is off, when the failure came
// in or after the update (parameters may be half-updated), or when micro-batch 1 did not fit.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "memory/cache_policy.h"

namespace headroom {

// Ordered by severity: data-parallel ranks agree on the largest.
enum class GuardAction { again = 1, halve = 2, give_up = 3 };

struct GuardDecision {
  GuardAction action = GuardAction::give_up;
  int64_t micro = 0;   // the micro-batch to run next (again: the same; halve: half, rounded up)
  std::string reason;  // again: why expandable segments should help
};

// `micro` failed; `cache` is a caching allocator's state at the failure (none for the counting
// allocator, or when the failure was an injected fault).
GuardDecision after_step_oom(int64_t micro, bool updating, bool guard_on, const std::optional<CacheState>& cache);

// The micro-batch after a halving: half, rounded up.
inline int64_t halved_micro(int64_t micro) { return (micro + 1) / 2; }

// Micro-batches of `micro` rows that cover `rows` (the last may be shorter).
inline int64_t accumulation_for(int64_t rows, int64_t micro) { return (rows + micro - 1) / micro; }

}  // namespace headroom
