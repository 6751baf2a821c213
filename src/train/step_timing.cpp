#include "train/step_timing.h"

#include <algorithm>

#include "train/trainer.h"
#include "util/interrupt.h"

namespace headroom {

std::optional<double> time_train_step(const RunConfig& base, Precision precision, int64_t rows, int timed) {
  // No guard: the time of this shape, or nothing when it does not fit.
  RunConfig cfg = as_trial(base, 1 + std::max(1, timed));
  cfg.batch = rows;
  cfg.accum = 1;
  cfg.precision = precision;
  cfg.checkpointing = CheckpointPolicy::none();
  cfg.attention = AttentionPath::flash;
  cfg.memory_budget.reset();  // timing only; memory is the estimator's business
  cfg.inject_leak = LeakInjection::none;
  const TrainResult r = train(cfg);
  throw_if_interrupted("while timing steps for the planner");
  if (!r.fits()) return std::nullopt;
  return r.median_step_seconds();
}

}  // namespace headroom
