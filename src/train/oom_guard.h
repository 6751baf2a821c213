// OomGuard — keeps a run alive when a step runs out of memory (the guard; lever 9 at
// run time).
//
// It runs each optimizer step (train/step.h). When the step raises an out-of-memory before the
// update, the failed step's memory is released (its activations went with the unwound stack; its
// gradients are dropped here) and the same global batch runs again — same rows, same order, same
// dropout seed — with half the micro-batch and twice the accumulation, down to micro-batch 1; the
// micro-batch stays lowered for the rest of the run. With a caching allocator (cuda, cpu with
// --allocator caching), fragmentation is tried first: when
// the free bytes split inside the cached segments could have held the request, the same
// micro-batch runs again in expandable segments (memory/cache_policy.h); after a reshape the cache
// is emptied when enough of it is idle. It gives up — returning the diagnosis, never throwing — when
// it is off (--no-guard), when micro-batch 1 does not fit, or when the failure came during or
// after the optimizer update (parameters may be half-updated; nothing can be re-run).
//
// --inject-oom is armed here, for the step it names, and disarmed when that step ends either way.
#pragma once

#include <cstdint>
#include <optional>

#include "memory/oom_report.h"
#include "train/run.h"
#include "train/step.h"

namespace headroom {

struct GuardedStep {
  StepOutcome outcome;
  int64_t micro = 0, accum = 0;  // the shape it finally ran with
  int64_t recoveries = 0;        // OOMs absorbed
  std::optional<OomReport> oom;  // set when the guard gave up: the step did not complete
};

class OomGuard {
 public:
  explicit OomGuard(Run& run);

  // Runs optimizer step `step` (0-based) to completion, or returns why it could not.
  GuardedStep run(int64_t step);

  // The micro-batch the next step starts with (the configured one, or what an OOM lowered it to).
  int64_t micro() const { return micro_; }

 private:
  OomReport diagnose(const c10::OutOfMemoryError& e, const StepShape& shape, bool updating);

  Run& run_;
  int64_t rows_;  // this rank's sequences per step
  int64_t micro_;
};

}  // namespace headroom
