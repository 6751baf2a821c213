#include "train/trainer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "config/model_config.h"
#include "data/text_dataset.h"
#include "memory/oom_report.h"
#include "model/causal_lm.h"
#include "testing/jsonl.h"
#include "testing/test_models.h"
#include "testing/temp_dir.h"
#include "util/error.h"

namespace headroom {
namespace {

using testing::read_jsonl;
using testing::TempDir;

// Held-out loss of the freshly initialised model, measured here, independently of train().
double initial_eval_loss(const RunConfig& cfg) {
  c10::NoGradGuard no_grad;
  CausalLM model(load_model_config(cfg.model, cfg.overrides), at::TensorOptions().dtype(at::kFloat), cfg.seed);
  const TextDataset data = TextDataset::load("", 0.1, cfg.seq);
  double sum = 0;
  int64_t n = 0;
  for (const Batch& b : data.eval_batches(cfg.batch, cfg.eval_rows)) {
    auto logits = model.forward(b.inputs, {AttentionPath::flash, false});
    auto loss =
        at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), b.targets.reshape({-1}), {}, at::Reduction::Sum);
    sum += loss.item<double>();
    n += b.tokens();
  }
  return sum / static_cast<double>(n);
}

TEST(Trainer, TinyLearnsTheBundledCorpus) {
  // Eval loss of `tiny` falls by at least 30% within 100 steps on CPU (to 0.44 of it in 120).
  RunConfig cfg;
  cfg.model = "tiny";
  cfg.steps = 100;
  cfg.device = "cpu";
  cfg.quiet = true;
  const double before = initial_eval_loss(cfg);
  EXPECT_NEAR(before, std::log(256.0), 0.1);  // near-uniform over bytes at init
  const TrainSummary s = train(cfg).summary;
  EXPECT_EQ(s.steps, 100);
  EXPECT_LE(s.eval_loss, 0.7 * before) << "before " << before << " after " << s.eval_loss;
}

// Every family learns: a shrunk model of each (testing/test_models.h) lowers its held-out loss on
// the bundled corpus within a short run.
class EveryFamilyLearns : public ::testing::TestWithParam<testing::ShrunkModel> {};

TEST_P(EveryFamilyLearns, HeldOutLossFalls) {
  RunConfig cfg;
  cfg.model = GetParam().preset;
  cfg.overrides = GetParam().overrides;
  cfg.steps = 60;
  cfg.batch = 8;
  cfg.seq = 64;
  cfg.eval_rows = 16;
  cfg.device = "cpu";
  cfg.quiet = true;
  const double before = initial_eval_loss(cfg);
  const TrainResult r = train(cfg);
  ASSERT_EQ(r.summary.steps, 60);
  EXPECT_LE(r.summary.eval_loss, 0.8 * before) << GetParam().label << ": before " << before << " after "
                                               << r.summary.eval_loss;
  // A mixture of experts reports the skew of its routing each step.
  EXPECT_EQ(r.steps.back().routing_skew.has_value(), GetParam().load().moe.has_value());
  if (r.summary.routing_skew) {
    EXPECT_GE(*r.summary.routing_skew, 1.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, EveryFamilyLearns, ::testing::ValuesIn(testing::shrunk_models()),
                         [](const auto& info) { return info.param.label; });

// The routing skew a mixture of experts reports is the routing's, whatever the checkpointing: a
// checkpointed layer reports from its forward (and its recompute) as a plain one does.
TEST(Trainer, RoutingSkewIsReportedUnderCheckpointingToo) {
  const auto models = testing::shrunk_models();
  const auto moe = std::find_if(models.begin(), models.end(), [](const auto& m) { return m.label == "qwen3_moe"; });
  ASSERT_NE(moe, models.end());
  std::vector<double> skews;
  for (const char* policy : {"none", "full", "selective"}) {
    RunConfig cfg;
    cfg.model = moe->preset;
    cfg.overrides = moe->overrides;
    cfg.steps = 1;
    cfg.batch = 4;
    cfg.seq = 32;
    cfg.eval_rows = 0;
    cfg.device = "cpu";
    cfg.quiet = true;
    cfg.checkpointing = parse_checkpoint_policy(policy);
    const TrainResult r = train(cfg);
    ASSERT_EQ(r.steps.size(), 1u) << policy;
    ASSERT_TRUE(r.steps[0].routing_skew.has_value()) << policy;
    skews.push_back(*r.steps[0].routing_skew);
  }
  EXPECT_GE(skews[0], 1.0);
  EXPECT_EQ(skews[1], skews[0]);  // the same weights route the same tokens alike
  EXPECT_EQ(skews[2], skews[0]);
}

TEST(Trainer, ResumeGivesTheIdenticalLossSequence) {
  TempDir dir;
  RunConfig cfg;
  // gpt2 layout with dropout on, so the RNG must be reproduced exactly too.
  cfg.model = "gpt2";
  cfg.overrides = {"n_layer=2", "n_embd=64", "n_head=4", "vocab_size=256", "n_positions=64"};
  cfg.steps = 8;
  cfg.batch = 4;
  cfg.seq = 32;
  cfg.accum = 2;
  cfg.device = "cpu";
  cfg.quiet = true;

  RunConfig straight = cfg;
  straight.metrics = dir.file("straight.jsonl");
  train(straight);

  RunConfig first = cfg;
  first.metrics = dir.file("resumed.jsonl");
  first.checkpoint = dir.file("ckpt");
  first.stop_at = 3;
  EXPECT_EQ(train(first).summary.steps, 3);
  RunConfig second = cfg;
  second.metrics = dir.file("resumed.jsonl");
  second.resume = dir.file("ckpt");
  EXPECT_EQ(train(second).summary.steps, 8);

  const auto a = read_jsonl(straight.metrics);
  const auto b = read_jsonl(second.metrics);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i]["step"], a[i]["step"]);
    EXPECT_EQ(b[i]["loss"].get<double>(), a[i]["loss"].get<double>()) << "step " << i + 1;
  }
  // Dropout was really on: the same step with another seed gives another loss.
  RunConfig reseeded = straight;
  reseeded.seed = 99;
  reseeded.metrics = dir.file("other.jsonl");
  train(reseeded);
  EXPECT_NE(read_jsonl(reseeded.metrics)[0]["loss"], a[0]["loss"]);
}

TEST(Trainer, MetricsCarryTheContractFields) {
  TempDir dir;
  RunConfig cfg;
  cfg.model = "tiny";
  cfg.overrides = {"num_hidden_layers=1"};
  cfg.steps = 2;
  cfg.batch = 2;
  cfg.seq = 16;
  cfg.device = "cpu";
  cfg.quiet = true;
  cfg.metrics = dir.file("m.jsonl");
  const TrainSummary s = train(cfg).summary;
  const auto lines = read_jsonl(cfg.metrics);
  ASSERT_EQ(lines.size(), 2u);
  for (const char* key :
       {"step", "loss", "tokens", "seconds", "peak_bytes", "live_bytes", "batch", "accum", "oom_recoveries"}) {
    EXPECT_TRUE(lines[1].contains(key)) << key;
  }
  EXPECT_EQ(lines[1]["tokens"], 2 * 16);
  // Live memory after a step holds at least weights + AdamW's two moments: 3 x 4 bytes per parameter.
  EXPECT_GE(lines[1]["live_bytes"].get<int64_t>(), 12 * s.params);
  EXPECT_GT(lines[1]["peak_bytes"].get<int64_t>(), lines[1]["live_bytes"].get<int64_t>());
}

// `tiny` by hand: embed 256x256; per layer q 256x256, k and v 256x128, o 256x256, gate/up/down
// 3x256x688, two norms of 256; four layers; final norm 256; untied head 256x256.
constexpr int64_t kTinyParams = 65536 + 4 * (65536 + 2 * 32768 + 65536 + 3 * 256 * 688 + 2 * 256) + 256 + 65536;
constexpr int64_t kTinyTensors = 1 + 4 * 9 + 1 + 1;
constexpr int64_t kCorpusBytes = 102726;  // data/corpus.txt, held as one byte per token
// Live after a step: fp32 weights, AdamW's two fp32 moments, one fp32 step counter per tensor, and
// the corpus.
constexpr int64_t kTinyLiveAfterStep = 12 * kTinyParams + 4 * kTinyTensors + kCorpusBytes;

RunConfig tiny_run(int64_t steps) {
  RunConfig cfg;
  cfg.model = "tiny";
  cfg.steps = steps;
  cfg.device = "cpu";
  cfg.quiet = true;
  return cfg;
}

TEST(TrainerMemory, StepPeaksAndBoundariesMatchHandComputedSizes) {
  TempDir dir;
  RunConfig cfg = tiny_run(2);
  cfg.metrics = dir.file("m.jsonl");
  const TrainSummary s = train(cfg).summary;
  ASSERT_EQ(s.params, kTinyParams);
  const auto lines = read_jsonl(cfg.metrics);
  const auto& step2 = lines[1];
  // The second step's peak holds at least weights + gradients + AdamW state: 16 bytes a parameter.
  EXPECT_GE(step2["peak_bytes"].get<int64_t>(), 16 * kTinyParams);
  EXPECT_EQ(step2["live_bytes"].get<int64_t>(), kTinyLiveAfterStep);
  // At the zero_grad boundary the categories add up to live memory exactly, and each is known.
  const auto& z = step2["phases"]["zero_grad"];
  EXPECT_EQ(z["live_out"].get<int64_t>(), kTinyLiveAfterStep);
  EXPECT_EQ(z["live_in"].get<int64_t>(), kTinyLiveAfterStep + 4 * kTinyParams);  // gradients still held
  const auto& b = step2["phases"]["optimizer"]["breakdown"];
  EXPECT_EQ(b["weights"].get<int64_t>(), 4 * kTinyParams);
  EXPECT_EQ(b["gradients"].get<int64_t>(), 4 * kTinyParams);
  EXPECT_EQ(b["optimizer"].get<int64_t>(), 8 * kTinyParams + 4 * kTinyTensors);
  EXPECT_EQ(b["other"].get<int64_t>(), kCorpusBytes);
  // Every phase's peak is at least what it started and ended with, and the step's peak is theirs.
  int64_t highest = 0;
  for (const char* phase : {"data", "forward", "backward", "optimizer", "zero_grad"}) {
    const auto& p = step2["phases"][phase];
    EXPECT_GE(p["peak"].get<int64_t>(), std::max(p["live_in"].get<int64_t>(), p["live_out"].get<int64_t>())) << phase;
    highest = std::max(highest, p["peak"].get<int64_t>());
  }
  EXPECT_EQ(highest, step2["peak_bytes"].get<int64_t>());
}

TEST(TrainerMemory, AnOomInsideAStepLeavesNothingBehind) {
  // Fail allocations across step 2 — in data, forward, backward and optimizer — and check each
  // ends the run with a diagnosis and live memory back at its level before the step.
  std::set<std::string> phases;
  for (int64_t nth : {1, 2, 40, 120, 250, 300, 330}) {
    RunConfig cfg = tiny_run(3);
    cfg.no_guard = true;
    cfg.inject_oom = parse_oom_injection(fmt::format("2:{}", nth));
    const TrainResult result = train(cfg);
    if (!result.oom) {
      ADD_FAILURE() << "no OOM for allocation " << nth;
    } else {
      const OomReport& r = *result.oom;
      EXPECT_EQ(r.step, 2);
      EXPECT_TRUE(r.injected);
      EXPECT_EQ(r.live_before_step, kTinyLiveAfterStep) << nth;
      EXPECT_EQ(r.live_after_cleanup, kTinyLiveAfterStep) << "allocation " << nth << " in " << phase_name(r.phase);
      // Weights and AdamW state are as computed by hand; the corpus is "other".
      EXPECT_EQ(r.breakdown.weights, 4 * kTinyParams);
      EXPECT_EQ(r.breakdown.optimizer, 8 * kTinyParams + 4 * kTinyTensors);
      EXPECT_EQ(r.breakdown.other, kCorpusBytes);
      phases.insert(std::string(phase_name(r.phase)));
    }
  }
  EXPECT_TRUE(phases.count("forward") && phases.count("backward")) << fmt::format("{}", fmt::join(phases, ","));
}

TEST(TrainerMemory, FaultInjectionIsReproducible) {
  auto once = [] {
    RunConfig cfg = tiny_run(2);
    cfg.no_guard = true;
    cfg.inject_oom = parse_oom_injection("2:150");
    return train(cfg).oom.value_or(OomReport{});
  };
  const OomReport a = once(), b = once();
  EXPECT_EQ(a.step, 2);
  EXPECT_EQ(a.phase, b.phase);
  EXPECT_EQ(a.requested, b.requested);
  EXPECT_EQ(a.in_use, b.in_use);
}

TEST(TrainerMemory, BudgetEndsTheRunWithTheDocumentedMessage) {
  RunConfig cfg = tiny_run(2);
  cfg.no_guard = true;
  cfg.memory_budget = int64_t{100} << 20;
  const TrainResult result = train(cfg);
  if (!result.oom) {
    ADD_FAILURE() << "tiny's ~120 MiB step fit in 100 MiB";
  } else {
    const OomReport& r = *result.oom;
    EXPECT_EQ(r.budget, 100 << 20);
    EXPECT_FALSE(r.injected);
    EXPECT_LE(r.in_use, r.budget);
    EXPECT_GT(r.in_use + r.requested, r.budget);
    EXPECT_THAT(r.message,
                ::testing::MatchesRegex("CPU out of memory \\(headroom budget\\) during [a-z_]+ of step 1\\. "
                                        "Tried to allocate .*\\. Budget 100 MiB; .* in use; .* free\\."));
  }
}

TEST(Trainer, ResumeRefusesAnotherConfigAndAFinishedRun) {
  TempDir dir;
  RunConfig cfg = tiny_run(2);
  cfg.overrides = {"num_hidden_layers=1"};
  cfg.batch = 2;
  cfg.seq = 16;
  cfg.checkpoint = dir.file("ckpt");
  train(cfg);
  RunConfig again = cfg;
  again.checkpoint.clear();
  again.resume = dir.file("ckpt");
  EXPECT_THAT([&] { train(again); }, ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                                         "the checkpoint is at step 2, which is already at or past --steps 2")));
  RunConfig other = again;
  other.steps = 4;
  other.overrides.push_back("rope_theta=500000");  // same shapes, different model
  EXPECT_THAT([&] { train(other); }, ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                                         "different model config (rope_theta: checkpoint 10000.0, this run 500000)")));
  // Adam's state has AdamW's tensors: only the recorded name tells them apart.
  RunConfig adam = again;
  adam.steps = 4;
  adam.optimizer = OptimizerKind::adam;
  EXPECT_THAT([&] { train(adam); }, ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                                        "trained with --optimizer adamw, this run has --optimizer adam")));
}

TEST(Trainer, ACheckpointPathThatCannotBeWrittenIsRefusedBeforeTheFirstStep) {
  TempDir dir;
  const std::string file = dir.file("not-a-dir");
  { std::ofstream(file) << "x"; }
  RunConfig cfg = tiny_run(2);
  cfg.overrides = {"num_hidden_layers=1"};
  cfg.checkpoint = file;
  cfg.metrics = dir.file("m.jsonl");
  EXPECT_THAT([&] { train(cfg); }, ::testing::ThrowsMessage<Error>(::testing::HasSubstr("is a file")));
  EXPECT_TRUE(read_jsonl(cfg.metrics).empty());  // nothing trained
}

}  // namespace
}  // namespace headroom
