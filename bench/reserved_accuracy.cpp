// Reserved memory: for the configurations of the estimator's test grid (real models, shrunk in
// depth), step 2 of a real `train` run on the cpu caching allocator (PyTorch's CUDA caching policy,
// memory/caching_policy.h), against the estimator's replay of the same step through that policy:
//   allocated — the peak of live tensor bytes, measured
//   reserved  — the peak of segments the allocator held, measured
//   predicted — the estimator's peak reserved bytes
//   missed    — what a "reserved = allocated" assumption (every other estimator's) leaves out:
//               measured reserved minus measured allocated, and its share of reserved
//
//   build/bench_reserved_accuracy
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "estimate/estimator.h"
#include "testing/estimate_grid.h"
#include "train/trainer.h"

int main() {
  using namespace headroom;
  const auto grid = testing::accuracy_grid();
  double worst = 0, sum = 0, missed_sum = 0, missed_worst = 0;
  std::printf("%-58s %11s %11s %11s %8s %11s %7s\n", "configuration", "allocated", "reserved", "predicted", "error",
              "missed", "share");
  for (RunConfig cfg : grid) {
    cfg.steps = 2;
    cfg.eval_rows = 0;
    cfg.quiet = true;
    cfg.allocator = AllocatorKind::caching;
    cfg.allocator_conf = "backend:native";
    const StepRecord step = train(cfg).steps.back();
    const int64_t allocated = step.peak_bytes, reserved = step.peak_reserved_bytes.value_or(0);
    const int64_t predicted = estimate(load_model_config(cfg.model, cfg.overrides), train_spec(cfg)).reserved->peak_reserved;
    const double error = static_cast<double>(predicted - reserved) / static_cast<double>(reserved);
    const double share = static_cast<double>(reserved - allocated) / static_cast<double>(reserved);
    worst = std::max(worst, std::abs(error));
    sum += std::abs(error);
    missed_sum += share;
    missed_worst = std::max(missed_worst, share);
    std::printf("%-58s %11lld %11lld %11lld %+7.3f%% %11lld %6.1f%%\n", testing::describe(cfg).c_str(),
                static_cast<long long>(allocated), static_cast<long long>(reserved), static_cast<long long>(predicted),
                100 * error, static_cast<long long>(reserved - allocated), 100 * share);
    std::fflush(stdout);
  }
  const double n = static_cast<double>(grid.size());
  std::printf("\npredicted reserved: mean |error| %.3f%%, worst %.3f%%\n", 100 * sum / n, 100 * worst);
  std::printf("reserved = allocated would miss: mean %.1f%% of reserved, worst %.1f%%\n", 100 * missed_sum / n,
              100 * missed_worst);
  return 0;
}
