#include "train/step_timing.h"

#include <algorithm>

#include "train/trainer.h"

namespace headroom {

double time_train_step(const RunConfig& base, Precision precision, int64_t rows, int timed) {
  // No guard: the time of this shape, or an OOM for the caller to handle.
  RunConfig cfg = as_trial(base, 1 + std::max(1, timed));
  cfg.batch = rows;
  cfg.accum = 1;
  cfg.precision = precision_name(precision);
  cfg.checkpointing = "none";
  cfg.attention = "flash";
  cfg.memory_budget.clear();  // timing only; memory is the estimator's business
  cfg.inject_leak.clear();
  return train(cfg).median_step_seconds();
}

}  // namespace headroom
