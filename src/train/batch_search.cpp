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

namespace {

// The estimator's prediction, corrected by what the trials measured: before any trial fitted, a
// scale from failed ones (a lower bound: their figure is what was in use plus the request); from
// one that fitted, the ratio measured / predicted; from two, the line through their differences (a
// wrong constant and a wrong slope both corrected).
class CorrectedPrediction {
 public:
  explicit CorrectedPrediction(const PeakPredictor& predict) : predict_(predict) {}

  // The estimator's own figure at `n` rows.
  double predicted(int64_t n) const { return static_cast<double>(predict_(n)); }

  double at(int64_t n) const {
    const double p = predicted(n);
    if (exact_.empty()) return p * low_scale_;
    const Point& last = exact_.back();
    if (exact_.size() == 1) return p * last.measured / last.predicted;
    const Point& prev = exact_[exact_.size() - 2];
    const double slope = ((last.measured - last.predicted) - (prev.measured - prev.predicted)) /
                         static_cast<double>(last.batch - prev.batch);
    return p + (last.measured - last.predicted) + slope * static_cast<double>(n - last.batch);
  }

  bool measured_a_fit() const { return !exact_.empty(); }

  void fitted(int64_t batch, int64_t peak_bytes, double predicted) {
    exact_.push_back({batch, static_cast<double>(peak_bytes), predicted});
  }

  void failed(int64_t peak_bytes, double predicted, int64_t budget) {
    low_scale_ = std::max(
        {low_scale_, static_cast<double>(peak_bytes) / predicted, (static_cast<double>(budget) + 1) / predicted});
  }

 private:
  struct Point {
    int64_t batch;
    double measured, predicted;
  };
  const PeakPredictor& predict_;
  std::vector<Point> exact_;  // the trials that fitted, in the order run
  double low_scale_ = 1.0;
};

// One search over [1, limit]: the trials run so far (each batch at most once, in the log in the
// order run) and the bounds they set. Invariant: `fits_` fits, `fails_` does not (limit + 1:
// untried).
class BatchSearch {
 public:
  BatchSearch(const TrialFunction& trial, int64_t budget, int64_t limit)
      : trial_(trial), budget_(budget), limit_(limit), fails_(limit + 1) {}

  // Predict, verify, correct (CorrectedPrediction); bisection when a prediction fails after one fitted.
  FitResult seeded_by(const PeakPredictor& predict);
  // The measured line of small batches does the predicting.
  FitResult measuring();

 private:
  Trial run(int64_t b);
  FitResult finish();
  int64_t predicted_largest_fit(const CorrectedPrediction& prediction) const;
  Trial until_the_peak_moves(const Trial& first, int64_t top);
  void secant_steps(const Trial& first, int64_t lo, Trial anchor);

  const TrialFunction& trial_;
  const int64_t budget_, limit_;
  FitResult out_;
  std::map<int64_t, Trial> seen_;
  int64_t fits_ = 0, fails_;
};

Trial BatchSearch::run(int64_t b) {
  auto it = seen_.find(b);
  if (it != seen_.end()) return it->second;
  out_.log.push_back(trial_(b));
  const Trial& t = out_.log.back();
  if (t.fits)
    fits_ = std::max(fits_, b);
  else
    fails_ = std::min(fails_, b);
  return seen_[b] = t;
}

// The fallback: double until something fails (or the limit), then bisect between the largest batch
// that fitted and the smallest that did not.
FitResult BatchSearch::finish() {
  while (fails_ > limit_ && fits_ > 0 && fits_ < limit_) run(std::min(limit_, fits_ * 2));
  while (fails_ - fits_ > 1) run(fits_ + (fails_ - fits_) / 2);
  out_.max_batch = fits_;
  return out_;
}

// The seed of each round: the largest untried batch that the corrected prediction says fits.
int64_t BatchSearch::predicted_largest_fit(const CorrectedPrediction& prediction) const {
  int64_t lo_b = fits_, hi_b = std::min(limit_, fails_ - 1) + 1;  // lo_b predicted to fit, hi_b not
  while (hi_b - lo_b > 1) {
    const int64_t mid = lo_b + (hi_b - lo_b) / 2;
    (prediction.at(mid) <= static_cast<double>(budget_) ? lo_b : hi_b) = mid;
  }
  return std::clamp<int64_t>(lo_b, fits_ + 1, std::min(limit_, fails_ - 1));
}

FitResult BatchSearch::seeded_by(const PeakPredictor& predict) {
  CorrectedPrediction prediction(predict);
  for (int round = 0; round < 8 && fails_ - fits_ > 1; ++round) {
    const int64_t guess = predicted_largest_fit(prediction);
    const Trial t = run(guess);
    const double predicted = prediction.predicted(guess);
    if (t.fits) {
      prediction.fitted(guess, t.peak_bytes, predicted);
    } else if (prediction.measured_a_fit()) {
      break;  // between a measured fit and this failure: bisection
    } else if (predicted > 0) {
      prediction.failed(t.peak_bytes, predicted, budget_);
    }
  }
  return finish();
}

// The line through two small batches. Batch 1 is avoided as a point of the line (some kernels take
// another path at one row), and tried only when batch 2 does not fit.
FitResult BatchSearch::measuring() {
  const int64_t lo = std::min<int64_t>(2, limit_), hi = std::min<int64_t>(4, limit_);
  const Trial a = run(lo);
  if (!a.fits) {
    if (lo > 1) run(1);
    return finish();
  }
  if (hi == lo) return finish();
  const Trial b = until_the_peak_moves(a, hi);
  if (!b.fits) return finish();
  secant_steps(a, lo, b);
  return finish();
}

// Memory that grows in coarse steps (allocator rounding) can look flat between small batches:
// double from `top` until the peak moves, so that the line has a slope.
Trial BatchSearch::until_the_peak_moves(const Trial& first, int64_t top) {
  Trial b = run(top);
  while (b.fits && b.peak_bytes <= first.peak_bytes && top < limit_) b = run(top = std::min(limit_, top * 2));
  return b;
}

// Secant steps: predict from the line through the first point (`first`, at batch `lo`) and the
// largest batch that fitted (the longer the baseline, the less rounding misleads it), verify, repeat.
void BatchSearch::secant_steps(const Trial& first, int64_t lo, Trial anchor) {
  double error = std::numeric_limits<double>::infinity();  // at the last verified prediction
  for (int round = 0; round < 8 && fails_ - fits_ > 1; ++round) {
    const double per_row =
        static_cast<double>(anchor.peak_bytes - first.peak_bytes) / static_cast<double>(anchor.batch - lo);
    if (per_row <= 0) break;
    const double fixed = static_cast<double>(first.peak_bytes) - per_row * static_cast<double>(lo);
    auto line = [&](int64_t n) { return fixed + per_row * static_cast<double>(n); };
    int64_t guess = static_cast<int64_t>(std::floor((static_cast<double>(budget_) - fixed) / per_row));
    if (guess <= fits_) {
      // The line says the largest batch that fitted is the maximum. The previous line missed the
      // verified batch by `error` over (anchor - lo) rows, so this one's slope is uncertain by about
      // error / (anchor - lo) a row: trust it when twice that still leaves the next batch over.
      const double slope_error = error / static_cast<double>(anchor.batch - lo);
      if (line(fits_ + 1) - 2 * slope_error > static_cast<double>(budget_)) {
        fails_ = fits_ + 1;
        break;
      }
      guess = fits_ + 1;
    }
    guess = std::clamp<int64_t>(guess, fits_ + 1, std::min(limit_, fails_ - 1));
    const Trial t = run(guess);
    if (!t.fits) break;  // the line overreached: bisect the (now short) interval
    error = std::abs(static_cast<double>(t.peak_bytes) - line(guess));
    anchor = t;
  }
}

}  // namespace

FitResult search_max_batch(const TrialFunction& trial, int64_t budget, int64_t limit, const PeakPredictor& predict) {
  BatchSearch search(trial, budget, limit);
  return predict ? search.seeded_by(predict) : search.measuring();
}

}  // namespace headroom
