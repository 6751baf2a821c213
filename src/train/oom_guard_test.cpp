// The OOM guard, proven the way SQLite proves its malloc-failure handling: fail every allocation of
// one global step in turn, one run per index; every run must finish, and its weights after the
// following step must match a clean run's.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "memory/oom_report.h"
#include "model/causal_lm.h"
#include "optim/optimizer.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace headroom {
namespace {

using testing::TempDir;

RunConfig guarded_run() {
  RunConfig cfg;
  cfg.model = "tiny";
  cfg.overrides = {"num_hidden_layers=1"};
  cfg.steps = 3;
  cfg.batch = 4;
  cfg.seq = 16;
  cfg.device = "cpu";
  cfg.quiet = true;
  cfg.eval_rows = 4;
  return cfg;
}

// The model's parameters as a run left them in its checkpoint.
std::vector<at::Tensor> final_weights(const RunConfig& cfg, const std::string& dir) {
  CausalLM model(load_model_config(cfg.model, cfg.overrides), at::TensorOptions().dtype(at::kFloat), 0);
  auto optimizer = make_optimizer(OptimizerKind::adamw, model.parameters(), {});
  load_checkpoint(dir, model.parameters(), optimizer->state());
  return model.parameter_tensors();
}

nlohmann::json metrics_line(const std::string& path, int64_t step) {
  for (const auto& j : testing::read_jsonl(path)) {
    if (j["step"] == step) return j;
  }
  return {};
}

TEST(OomGuard, EveryAllocationOfAStepCanFailAndTheRunStillMatches) {
  TempDir dir;
  RunConfig clean = guarded_run();
  clean.checkpoint = dir.file("clean");
  train(clean);
  const auto reference = final_weights(clean, clean.checkpoint);

  int64_t failed_in_step = 0;
  double worst = 0;
  for (int64_t nth = 1;; ++nth) {
    ASSERT_LT(nth, 5000) << "the step never stopped allocating";
    RunConfig cfg = guarded_run();
    cfg.inject_oom = fmt::format("2:{}", nth);
    cfg.checkpoint = dir.file("run");
    cfg.metrics = dir.file("run.jsonl");
    try {
      train(cfg);
    } catch (const OutOfMemory& e) {
      FAIL() << "allocation " << nth << " of step 2 ended the run: " << e.report().to_text();
    }
    const auto step2 = metrics_line(cfg.metrics, 2);
    if (step2["oom_recoveries"] == 0) break;  // past the step's last allocation
    ++failed_in_step;
    EXPECT_EQ(step2["oom_recoveries"], 1) << nth;
    EXPECT_EQ(step2["batch"], 2) << nth;  // half the micro-batch...
    EXPECT_EQ(step2["accum"], 2) << nth;  // ...twice the accumulation: the same global batch
    EXPECT_EQ(step2["tokens"], 4 * 16) << nth;
    const auto weights = final_weights(cfg, cfg.checkpoint);
    for (size_t i = 0; i < weights.size(); ++i) {
      const double diff = (weights[i] - reference[i]).abs().max().item<double>();
      worst = std::max(worst, diff);
      ASSERT_LT(diff, 1e-4) << "allocation " << nth << ", parameter " << i;
    }
  }
  EXPECT_GT(failed_in_step, 50);  // a step makes hundreds of allocations; every one was tried
  RecordProperty("allocations_tried", static_cast<int>(failed_in_step));
  RecordProperty("worst_weight_difference", fmt::format("{:.3g}", worst));
  std::printf("failed each of %ld allocations of step 2 in turn; worst weight difference %.3g\n",
              static_cast<long>(failed_in_step), worst);
}

TEST(OomGuard, OffMeansTheFirstOomEndsTheRun) {
  RunConfig cfg = guarded_run();
  cfg.no_guard = true;
  cfg.inject_oom = "2:10";
  EXPECT_THROW(train(cfg), OutOfMemory);
}

TEST(OomGuard, GivesUpAtMicroBatchOneNamingTheLevers) {
  TempDir dir;
  RunConfig cfg = guarded_run();
  cfg.batch = 8;
  cfg.seq = 128;
  cfg.overrides = {};
  cfg.memory_budget = "40MiB";  // tiny's weights and AdamW state alone are 35 MiB
  cfg.checkpoint = dir.file("ckpt");
  try {
    train(cfg);
    FAIL() << "fit in 40 MiB";
  } catch (const OutOfMemory& e) {
    EXPECT_THAT(e.report().advice, ::testing::HasSubstr("micro-batch 1 does not fit either"));
    EXPECT_THAT(e.report().advice, ::testing::HasSubstr("--optimizer adafactor or sgd"));
    // The estimator's numbers: adafactor's state is what makes micro-batch 1 fit in 40 MiB (tiny's
    // weights 11.6 MiB, gradients 11.6 MiB, AdamW's moments 23.1 MiB).
    EXPECT_THAT(e.report().advice, ::testing::HasSubstr("by the estimator, at micro-batch 1"));
    EXPECT_THAT(e.report().advice, ::testing::ContainsRegex("--optimizer adafactor [0-9.]+ MiB \\(fits\\)"));
    EXPECT_THAT(e.report().advice, ::testing::ContainsRegex("--checkpointing full [0-9.]+ MiB \\(does not fit\\)"));
  }
}

}  // namespace
}  // namespace headroom
