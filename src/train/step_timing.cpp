#include "train/step_timing.h"

#include <algorithm>
#include <vector>

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
  const TrainSummary s = train(cfg);
  std::vector<double> times(s.step_seconds.begin() + 1, s.step_seconds.end());
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace headroom
