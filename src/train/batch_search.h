// Batch-size search (lever 9): the largest micro-batch that fits, found with as few real trial
// steps as possible.
//
// Seeded by the estimator (as `headroom fit` runs it), the search tries the batch the estimator
// predicts is the largest, then corrects by what the trial measured (see search_max_batch). Without
// one it measures: a step's peak memory is affine in the micro-batch (weights, gradients and optimizer state fixed;
// activations, logits and temporaries proportional to the rows), which the search uses: it measures
// batches 2 and 4 (doubling the second while the peak looks flat, as allocator rounding can make
// it), predicts the largest batch under the budget from the line through them, verifies it, and
// repeats from the line through batch 2 and the largest batch verified (a longer baseline, less
// misled by rounding) until the line and the trials agree. A batch next to a verified one is taken
// as failing without a trial only when the line, allowing twice the slope error it showed at the
// verified batch, says so. When a
// prediction fails, it bisects between the largest batch that fitted and the smallest that did not.
// On memory that is exactly affine it takes three trials. Every trial is a real training step under
// the budget; a failed trial leaves nothing behind (train() releases a failed step).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <vector>

#include "config/run_config.h"

namespace headroom {

struct Trial {
  int64_t batch = 0;
  bool fits = false;
  int64_t peak_bytes = 0;  // of the step when it fitted; of what was in use plus the request when not
};

using TrialFunction = std::function<Trial(int64_t batch)>;

struct FitResult {
  int64_t max_batch = 0;           // 0: not even batch 1 fits
  std::vector<Trial> log;          // in the order run
  nlohmann::json to_json() const;  // {"max_batch", "trials", "log": [{"batch", "fits", "peak_bytes"}]}
};

// Predicted peak bytes of a step at a micro-batch (the estimator's), or null.
using PeakPredictor = std::function<int64_t(int64_t batch)>;

// Searches [1, limit] with `trial`, under `budget` bytes (used for the prediction). With `predict`
// (the estimator) the search is seeded by it: the largest batch it says fits is tried, then the
// next one; a trial that disagrees corrects the prediction by the measured difference and the
// search predicts again; bisection remains the fallback. With an exact estimator: two trials.
// Without one, the measured line of batches 2 and 4 does the predicting (three trials on affine
// memory).
FitResult search_max_batch(const TrialFunction& trial, int64_t budget, int64_t limit,
                           const PeakPredictor& predict = nullptr);

// One real training step of `base` at micro-batch `batch` (accumulation 1, no guard, no evaluation,
// no outputs) under base's --memory-budget.
Trial trial_step(const RunConfig& base, int64_t batch);

}  // namespace headroom
