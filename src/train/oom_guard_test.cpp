// The OOM guard, proven the way SQLite proves its malloc-failure handling: fail every allocation of
// one global step in turn, one run per index; every run must finish, and its weights after the
// following step must match a clean run's.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
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
    cfg.inject_oom = parse_oom_injection(fmt::format("2:{}", nth));
    cfg.checkpoint = dir.file("run");
    cfg.metrics = dir.file("run.jsonl");
    const TrainResult r = train(cfg);
    ASSERT_TRUE(r.fits()) << "allocation " << nth << " of step 2 ended the run: " << r.oom->to_text();
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

// A mixture of experts (shrunk qwen3_moe: experts in layers 0 and 2, a dense layer between): the
// guard recovers from an OOM at every tenth allocation of step 2 by splitting the micro-batch, and
// the run ends with the weights of the run that had none — the routing is per token, so the
// halves route as the whole did.
TEST(OomGuard, AMixtureOfExpertsSurvivesAndEndsWithTheSameWeights) {
  TempDir dir;
  auto moe = [] {
    RunConfig cfg = guarded_run();
    cfg.model = "qwen3-30b-a3b";
    cfg.overrides = {"hidden_size=64", "intermediate_size=128", "num_attention_heads=4", "num_key_value_heads=2",
                     "num_hidden_layers=3", "vocab_size=256", "head_dim=16", "moe_intermediate_size=32",
                     "num_experts=4", "num_experts_per_tok=2", "mlp_only_layers=[1]"};
    return cfg;
  };
  RunConfig clean = moe();
  clean.checkpoint = dir.file("clean");
  ASSERT_TRUE(train(clean).fits());
  const auto reference = final_weights(clean, clean.checkpoint);
  int recovered = 0;
  for (int64_t nth = 1; nth < 2000; nth += 10) {
    RunConfig cfg = moe();
    cfg.inject_oom = parse_oom_injection(fmt::format("2:{}", nth));
    cfg.checkpoint = dir.file("run");
    cfg.metrics = dir.file("run.jsonl");
    const TrainResult r = train(cfg);
    ASSERT_TRUE(r.fits()) << "allocation " << nth << " of step 2 ended the run: " << r.oom->to_text();
    const auto step2 = metrics_line(cfg.metrics, 2);
    if (step2["oom_recoveries"] == 0) break;  // past the step's last allocation
    ++recovered;
    EXPECT_EQ(step2["tokens"], 4 * 16) << nth;
    const auto weights = final_weights(cfg, cfg.checkpoint);
    ASSERT_EQ(weights.size(), reference.size());
    for (size_t i = 0; i < weights.size(); ++i) {
      ASSERT_LT((weights[i] - reference[i]).abs().max().item<double>(), 1e-4) << "allocation " << nth << ", parameter " << i;
    }
  }
  EXPECT_GT(recovered, 10);  // the experts' allocations are among those that failed
}

TEST(OomGuard, OffMeansTheFirstOomEndsTheRun) {
  RunConfig cfg = guarded_run();
  cfg.no_guard = true;
  cfg.inject_oom = parse_oom_injection("2:10");
  const TrainResult r = train(cfg);
  ASSERT_TRUE(r.oom.has_value());
  EXPECT_EQ(r.oom->step, 2);
  EXPECT_FALSE(r.oom->guard_on);
  EXPECT_TRUE(r.oom->injected);
  // The step before the failure is kept, as a value: the run's records are not lost with the OOM.
  ASSERT_EQ(r.steps.size(), 1u);
  EXPECT_EQ(r.steps[0].step, 1);
  EXPECT_EQ(r.summary.steps, 1);
}

TEST(OomGuard, GivesUpAtMicroBatchOneWithTheDiagnosis) {
  TempDir dir;
  RunConfig cfg = guarded_run();
  cfg.batch = 8;
  cfg.seq = 128;
  cfg.overrides = {};
  cfg.memory_budget = int64_t{40} << 20;  // tiny's weights and AdamW state alone are 35 MiB
  cfg.checkpoint = dir.file("ckpt");
  const TrainResult r = train(cfg);
  ASSERT_FALSE(r.fits()) << "fit in 40 MiB";
  EXPECT_EQ(r.oom->step, 1);
  EXPECT_EQ(r.oom->micro_batch, 1);  // halved 8 -> 4 -> 2 -> 1 before giving up
  EXPECT_TRUE(r.oom->guard_on);
  EXPECT_EQ(r.oom->budget, int64_t{40} << 20);
  EXPECT_LE(r.oom->live_after_cleanup, r.oom->live_before_step);  // the failed step's memory is released
  EXPECT_TRUE(r.steps.empty());
}

// A run the guard rescued must not die on its last step's evaluation, which used to run at the
// configured micro-batch: tiny at seq 256 in 128 MiB recovers to a smaller micro-batch, and its
// evaluation (64 held-out rows) runs in batches of that size.
TEST(OomGuard, EvaluationRunsAtTheMicroBatchTheGuardLoweredTo) {
  RunConfig cfg = guarded_run();
  cfg.overrides = {};
  cfg.steps = 1;
  cfg.batch = 64;
  cfg.seq = 256;
  cfg.eval_rows = 64;
  cfg.memory_budget = int64_t{128} << 20;
  const TrainResult r = train(cfg);
  ASSERT_TRUE(r.fits()) << r.oom->to_text();
  ASSERT_EQ(r.steps.size(), 1u);
  EXPECT_LT(r.steps[0].batch, 64);
  EXPECT_GE(r.steps[0].oom_recoveries, 1);
  ASSERT_TRUE(r.steps[0].eval_loss.has_value());
  EXPECT_TRUE(std::isfinite(*r.steps[0].eval_loss));
}

}  // namespace
}  // namespace headroom
