// Learning-rate schedule: linear warm-up to the peak, then cosine decay to peak * min_ratio at the
// last step. A pure function of the step, so a resumed run follows the same curve.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

namespace headroom {

struct LrSchedule {
  double peak = 3e-3;
  double min_ratio = 0.1;
  int64_t warmup = 1;
  int64_t total = 1;

  // Learning rate for the optimizer step with 0-based index `step`.
  double at(int64_t step) const {
    if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
    const int64_t decay_steps = std::max<int64_t>(1, total - warmup - 1);
    const double progress = std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(decay_steps));
    const double floor = peak * min_ratio;
    return floor + 0.5 * (peak - floor) * (1.0 + std::cos(std::numbers::pi * progress));
  }
};

}  // namespace headroom
