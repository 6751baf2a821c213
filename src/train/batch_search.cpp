#include "train/batch_search.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "memory/oom_report.h"
#include "train/trainer.h"
#include "util/error.h"
#include "util/interrupt.h"

namespace headroom {

nlohmann::json FitResult::to_json() const {
  nlohmann::json entries = nlohmann::json::array();
  for (const Trial& t : log) entries.push_back({{"batch", t.batch}, {"fits", t.fits}, {"peak_bytes", t.peak_bytes}});
  return {{"max_batch", max_batch}, {"trials", static_cast<int64_t>(log.size())}, {"log", entries}};
}

Trial trial_step(const RunConfig& base, int64_t batch) {
  RunConfig cfg = as_trial(base, 1);
  cfg.batch = batch;
  cfg.accum = 1;
  const TrainResult r = train(cfg);
  throw_if_interrupted("during fit's trials");
  return {batch, r.fits(), r.peak_or_failure_bytes()};
}

FitResult search_max_batch(const TrialFunction& trial, int64_t budget, int64_t limit, const PeakPredictor& predict) {
  FitResult out;
  std::map<int64_t, Trial> seen;
  int64_t fits = 0, fails = limit + 1;  // invariant: `fits` fits, `fails` does not (limit + 1: untried)
  auto run = [&](int64_t b) -> Trial {
    auto it = seen.find(b);
    if (it != seen.end()) return it->second;
    out.log.push_back(trial(b));
    const Trial& t = out.log.back();
    if (t.fits)
      fits = std::max(fits, b);
    else
      fails = std::min(fails, b);
    return seen[b] = t;
  };
  auto finish = [&]() {
    // The fallback: double until something fails (or the limit), then bisect between the largest
    // batch that fitted and the smallest that did not.
    while (fails > limit && fits > 0 && fits < limit) run(std::min(limit, fits * 2));
    while (fails - fits > 1) run(fits + (fails - fits) / 2);
    out.max_batch = fits;
    return out;
  };

  if (predict) {
    // Predict, verify, correct. The correction comes from what the trials measured: before any
    // trial fitted, a scale from failed ones (a lower bound: their figure is what was in use plus
    // the request); from one that fitted, the ratio measured / predicted; from two, the line
    // through their differences (a wrong constant and a wrong slope both corrected).
    struct Point {
      int64_t batch;
      double measured, predicted;
    };
    std::vector<Point> exact;
    double low_scale = 1.0;
    auto corrected = [&](int64_t n) {
      const double p = static_cast<double>(predict(n));
      if (exact.empty()) return p * low_scale;
      const Point& last = exact.back();
      if (exact.size() == 1) return p * last.measured / last.predicted;
      const Point& prev = exact[exact.size() - 2];
      const double slope = ((last.measured - last.predicted) - (prev.measured - prev.predicted)) /
                           static_cast<double>(last.batch - prev.batch);
      return p + (last.measured - last.predicted) + slope * static_cast<double>(n - last.batch);
    };
    for (int round = 0; round < 8 && fails - fits > 1; ++round) {
      int64_t lo_b = fits, hi_b = std::min(limit, fails - 1) + 1;  // lo_b predicted to fit, hi_b not
      while (hi_b - lo_b > 1) {
        const int64_t mid = lo_b + (hi_b - lo_b) / 2;
        (corrected(mid) <= static_cast<double>(budget) ? lo_b : hi_b) = mid;
      }
      const int64_t guess = std::clamp<int64_t>(lo_b, fits + 1, std::min(limit, fails - 1));
      const Trial t = run(guess);
      const double predicted = static_cast<double>(predict(guess));
      if (t.fits) {
        exact.push_back({guess, static_cast<double>(t.peak_bytes), predicted});
      } else if (!exact.empty()) {
        break;  // between a measured fit and this failure: bisection
      } else if (predicted > 0) {
        low_scale = std::max(
            {low_scale, static_cast<double>(t.peak_bytes) / predicted, (static_cast<double>(budget) + 1) / predicted});
      }
    }
    return finish();
  }

  // The line through two small batches. Batch 1 is avoided as a point of the line (some kernels
  // take another path at one row), and tried only when batch 2 does not fit.
  const int64_t lo = std::min<int64_t>(2, limit), hi = std::min<int64_t>(4, limit);
  const Trial a = run(lo);
  if (!a.fits) {
    if (lo > 1) run(1);
    return finish();
  }
  if (hi == lo) return finish();
  int64_t top = hi;
  Trial b = run(top);
  // Memory that grows in coarse steps (allocator rounding) can look flat between small batches:
  // double until the peak moves, so that the line has a slope.
  while (b.fits && b.peak_bytes <= a.peak_bytes && top < limit) b = run(top = std::min(limit, top * 2));
  if (!b.fits) return finish();
  // Secant steps: predict from the line through the first point and the largest batch that fitted
  // (the longer the baseline, the less rounding misleads it), verify, repeat.
  Trial anchor = b;
  double error = std::numeric_limits<double>::infinity();  // at the last verified prediction
  for (int round = 0; round < 8 && fails - fits > 1; ++round) {
    const double per_row =
        static_cast<double>(anchor.peak_bytes - a.peak_bytes) / static_cast<double>(anchor.batch - lo);
    if (per_row <= 0) break;
    const double fixed = static_cast<double>(a.peak_bytes) - per_row * static_cast<double>(lo);
    auto predict = [&](int64_t n) { return fixed + per_row * static_cast<double>(n); };
    int64_t guess = static_cast<int64_t>(std::floor((static_cast<double>(budget) - fixed) / per_row));
    if (guess <= fits) {
      // The line says the largest batch that fitted is the maximum. The previous line missed the
      // verified batch by `error` over (anchor - lo) rows, so this one's slope is uncertain by about
      // error / (anchor - lo) a row: trust it when twice that still leaves the next batch over.
      const double slope_error = error / static_cast<double>(anchor.batch - lo);
      if (predict(fits + 1) - 2 * slope_error > static_cast<double>(budget)) {
        fails = fits + 1;
        break;
      }
      guess = fits + 1;
    }
    guess = std::clamp<int64_t>(guess, fits + 1, std::min(limit, fails - 1));
    const Trial t = run(guess);
    if (!t.fits) break;  // the line overreached: bisect the (now short) interval
    error = std::abs(static_cast<double>(t.peak_bytes) - predict(guess));
    anchor = t;
  }
  return finish();
}

}  // namespace headroom
