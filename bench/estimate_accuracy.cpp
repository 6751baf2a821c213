// Estimate accuracy: for the configurations of the estimator's test grid (real models, shrunk in depth), the peak the budget
// allocator measures in step 2 of a real `train` run, next to three predictions:
//   headroom    — estimate/estimator.h (the step replayed operator by operator)
//   states      — model states only, as DeepSpeed's and Accelerate's estimators count: weights,
//                 gradients and optimizer state (given the exact per-parameter bytes, their best case)
//   korthikanti — states plus the per-layer activation formula of Korthikanti et al. (2022),
//                 s·b·h·(34 + 5·a·s/h) bytes per layer for 16-bit activations (scaled here to 4-byte
//                 ones for fp32 runs), 34·s·b·h with selective recompute, 2·s·b·h with full
//                 recompute; logits and loss are outside that formula.
//
//   build/bench_estimate_accuracy
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "estimate/estimator.h"
#include "testing/estimate_grid.h"
#include "train/trainer.h"

namespace {

using namespace headroom;

int64_t state_bytes_per_param(const RunConfig& c) {
  const int64_t w = c.precision == Precision::bf16 ? 2 : 4;
  if (is_adam_family(c.optimizer)) return 2 * w;
  if (c.optimizer == OptimizerKind::momentum || c.optimizer == OptimizerKind::adagrad) return w;
  return 0;  // sgd; adafactor's factored moments are negligible per parameter
}

// The corpus the trainer holds on cpu is added to both references, so that they are not blamed
// for it.
// With --finetune, gradients and state only for the trainable parameters (LoRA's adapters count as weights).
int64_t model_states(const RunConfig& c, const ModelConfig& m) {
  const int64_t w = c.precision == Precision::bf16 ? 2 : 4;
  const Estimate e = estimate(m, train_spec(c));
  return e.params * w + e.trainable_params * (w + state_bytes_per_param(c)) + train_spec(c).dataset_bytes;
}

int64_t korthikanti(const RunConfig& c, const ModelConfig& m) {
  const double s = static_cast<double>(c.seq), b = static_cast<double>(c.batch);
  const double h = static_cast<double>(m.hidden_size), a = static_cast<double>(m.num_heads);
  const double scale = c.precision == Precision::fp32 ? 2.0 : 1.0;  // the formula counts 2-byte activations
  double per_layer = s * b * h * (34 + 5 * a * s / h);
  if (c.checkpointing == CheckpointPolicy::selective()) per_layer = 34 * s * b * h;
  if (c.checkpointing == CheckpointPolicy::full()) per_layer = 2 * s * b * h;
  return model_states(c, m) + static_cast<int64_t>(per_layer * scale * static_cast<double>(m.num_layers));
}

}  // namespace

int main() {
  const auto grid = testing::accuracy_grid();
  struct Stats {
    double sum = 0, worst = 0;
    void add(double e) {
      sum += std::abs(e);
      worst = std::max(worst, std::abs(e));
    }
  } ours, states, kort;
  std::printf("%-58s %11s %9s %9s %11s\n", "configuration", "measured", "headroom", "states", "korthikanti");
  for (size_t i = 0; i < grid.size(); ++i) {
    RunConfig cfg = grid[i];
    cfg.steps = 2;
    cfg.eval_rows = 0;
    cfg.quiet = true;
    const int64_t measured = train(cfg).steps.back().peak_bytes;
    const ModelConfig m = load_model_config(cfg.model, cfg.overrides);
    auto err = [&](int64_t predicted) {
      return static_cast<double>(predicted - measured) / static_cast<double>(measured);
    };
    const double e1 = err(estimate(m, train_spec(cfg)).step_peak());
    const double e2 = err(model_states(cfg, m));
    const double e3 = err(korthikanti(cfg, m));
    ours.add(e1);
    states.add(e2);
    kort.add(e3);
    std::printf("%-58s %11lld %+8.2f%% %+8.1f%% %+10.1f%%\n", testing::describe(cfg).c_str(),
                static_cast<long long>(measured), 100 * e1, 100 * e2, 100 * e3);
  }
  const double n = static_cast<double>(grid.size());
  std::printf("\n%-58s %11s %9s %9s %11s\n", "", "", "headroom", "states", "korthikanti");
  std::printf("%-58s %11s %8.2f%% %8.1f%% %10.1f%%\n", "mean |error|", "", 100 * ours.sum / n, 100 * states.sum / n,
              100 * kort.sum / n);
  std::printf("%-58s %11s %8.2f%% %8.1f%% %10.1f%%\n", "worst |error|", "", 100 * ours.worst, 100 * states.worst,
              100 * kort.worst);
  return 0;
}
