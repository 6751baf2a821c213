#include "train/trainer.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>

#include "config/model_config.h"
#include "data/text_dataset.h"
#include "model/causal_lm.h"
#include "testing/temp_dir.h"

namespace headroom {
namespace {

using testing::TempDir;

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Held-out loss of the freshly initialised model, measured here, independently of train().
double initial_eval_loss(const RunConfig& cfg) {
  c10::NoGradGuard no_grad;
  CausalLM model(load_model_config(cfg.model, cfg.overrides), at::TensorOptions().dtype(at::kFloat), cfg.seed);
  const TextDataset data = TextDataset::load("", 0.1, cfg.seq);
  double sum = 0;
  int64_t n = 0;
  for (const Batch& b : data.eval_batches(cfg.batch, cfg.eval_rows)) {
    auto logits = model.forward(b.inputs, {AttentionPath::flash, false});
    auto loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), b.targets.reshape({-1}), {},
                                       at::Reduction::Sum);
    sum += loss.item<double>();
    n += b.tokens();
  }
  return sum / static_cast<double>(n);
}

TEST(Trainer, TinyLearnsTheBundledCorpus) {
  // Eval loss of `tiny` falls by at least 30% within 200 steps on CPU.
  RunConfig cfg;
  cfg.model = "tiny";
  cfg.steps = 200;
  cfg.device = "cpu";
  cfg.quiet = true;
  const double before = initial_eval_loss(cfg);
  EXPECT_NEAR(before, std::log(256.0), 0.1);  // near-uniform over bytes at init
  const TrainSummary s = train(cfg);
  EXPECT_EQ(s.steps, 200);
  EXPECT_LE(s.eval_loss, 0.7 * before) << "before " << before << " after " << s.eval_loss;
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
  EXPECT_EQ(train(first).steps, 3);
  RunConfig second = cfg;
  second.metrics = dir.file("resumed.jsonl");
  second.resume = dir.file("ckpt");
  EXPECT_EQ(train(second).steps, 8);

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
  const TrainSummary s = train(cfg);
  const auto lines = read_jsonl(cfg.metrics);
  ASSERT_EQ(lines.size(), 2u);
  for (const char* key : {"step", "loss", "tokens", "seconds", "peak_bytes", "live_bytes", "batch", "accum",
                          "oom_recoveries"}) {
    EXPECT_TRUE(lines[1].contains(key)) << key;
  }
  EXPECT_EQ(lines[1]["tokens"], 2 * 16);
  // Live memory after a step holds at least weights + AdamW's two moments: 3 x 4 bytes per parameter.
  EXPECT_GE(lines[1]["live_bytes"].get<int64_t>(), 12 * s.params);
  EXPECT_GT(lines[1]["peak_bytes"].get<int64_t>(), lines[1]["live_bytes"].get<int64_t>());
}

}  // namespace
}  // namespace headroom
