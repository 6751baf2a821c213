// Per-op checkpointing (model/op_checkpoint.h) on the trainer's model at real widths and
// vocabularies (depth shrunk): the loss and every gradient against no checkpointing, and what a
// layer keeps from its forward to its backward against the policy counted by hand.
#include "model/op_checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "config/run_config.h"
#include "estimate/estimator.h"
#include "device/autocast_adapter.h"
#include "memory/budget_allocator.h"
#include "model/causal_lm.h"
#include "train/precision.h"
#include "train/step_ops.h"
#include "train/trainer.h"

namespace headroom {
namespace {

struct Pass {
  double loss = 0;
  int64_t kept = 0;  // live bytes after the forward and the loss, before backward
  std::vector<at::Tensor> grads;
};

Pass one_pass(const CausalLM& model, const at::Tensor& batch, Precision precision, CheckpointPolicy checkpointing,
              bool backward = true) {
  const at::Tensor inputs = batch.narrow(1, 0, batch.size(1) - 1), targets = batch.narrow(1, 1, batch.size(1) - 1);
  BudgetAllocator& allocator = BudgetAllocator::install();
  const int64_t before = allocator.live_bytes();
  ForwardOptions forward;
  forward.checkpoint = checkpointing;
  at::Tensor loss;
  {
    const AutocastScope autocast(c10::DeviceType::CPU, forward_autocast(precision));
    loss = model_loss(model, inputs, targets, forward, LossSetting{});
  }
  Pass p;
  p.kept = allocator.live_bytes() - before;
  p.loss = loss.item<double>();
  if (!backward) return p;
  loss.backward();
  for (const NamedTensor& q : model.parameters()) {
    p.grads.push_back(q.tensor.grad().clone());
    q.tensor.mutable_grad() = at::Tensor();
  }
  return p;
}

at::Tensor batch_for(const ModelConfig& c, int64_t rows, int64_t seq) {
  at::manual_seed(3);
  return at::randint(c.vocab_size, {rows, seq + 1}, at::TensorOptions().dtype(at::kLong));
}

// The recomputed layers run the same operators on the same inputs, and the kept matmuls' backward
// is mm's: the same loss and gradients, whatever the precision or the biases (qwen2.5's q, k and v
// have them: aten::addmm, recomputed and not counted).
TEST(OpCheckpoint, TheSameLossAndGradientsAsWithout) {
  struct Case {
    std::string model;
    std::vector<std::string> overrides;
    Precision precision;
  };
  for (const Case& k : {Case{"smollm-135m", {"num_hidden_layers=2"}, Precision::fp32},
                        Case{"smollm-135m", {"num_hidden_layers=2"}, Precision::bf16_mixed},
                        Case{"qwen2.5-0.5b", {"num_hidden_layers=1"}, Precision::fp32}}) {
    const ModelConfig c = load_model_config(k.model, k.overrides);
    const CausalLM model(c, at::TensorOptions().dtype(at::kFloat), 7);
    const at::Tensor batch = batch_for(c, 2, 32);
    const Pass plain = one_pass(model, batch, k.precision, CheckpointPolicy::none());
    const Pass ops = one_pass(model, batch, k.precision, CheckpointPolicy::ops());
    const std::string what = k.model + " " + precision_name(k.precision);
    EXPECT_EQ(ops.loss, plain.loss) << what;
    double worst = 0;
    for (size_t i = 0; i < plain.grads.size(); ++i) {
      const double norm = plain.grads[i].norm().item<double>();
      ASSERT_GT(norm, 0) << model.parameters()[i].name;
      worst = std::max(worst, (ops.grads[i] - plain.grads[i]).norm().item<double>() / norm);
    }
    EXPECT_LE(worst, 1e-6) << what;
    std::printf("  %s: loss %.8f both; largest gradient difference %.3g of its norm\n", what.c_str(), ops.loss, worst);
  }
}

// What a layer keeps, from the live bytes of the same forward at 3 and at 2 layers (the difference
// is one layer: its weights and what it keeps). SmolLM-135M's widths: hidden 576, 9 query heads and
// 3 key/value heads of 64, intermediate 1536. Its forward's matmuls are q, k, v, o, gate, up, down:
// the 1st, 3rd, 5th and 7th are kept (q, v, gate, down), with attention's output and float32
// log-sum-exp, the layer's input and the random state the recompute replays.
TEST(OpCheckpoint, ALayerKeepsEverySecondMatmulAndAttention) {
  const int64_t b = 2, t = 64, hidden = 576, heads = 9, kv_heads = 3, hd = 64, inter = 1536;
  const int64_t tokens = b * t, f32 = 4;
  const int64_t layer_weights =
      (hidden * heads * hd * 2 + hidden * kv_heads * hd * 2 + 3 * hidden * inter + 2 * hidden) * f32;
  const int64_t rng = at::detail::getDefaultCPUGenerator().get_state().nbytes();
  const int64_t input = tokens * hidden * f32;
  const int64_t kept = tokens * heads * hd * f32       // q
                       + tokens * kv_heads * hd * f32  // v
                       + tokens * heads * hd * f32     // attention's output
                       + b * heads * t * f32           // its log-sum-exp
                       + tokens * inter * f32          // gate
                       + tokens * hidden * f32;        // down
  auto layer_bytes = [&](CheckpointPolicy policy) {
    int64_t live[2];
    for (int64_t layers : {2, 3}) {
      const ModelConfig c = load_model_config("smollm-135m", {"num_hidden_layers=" + std::to_string(layers)});
      const BudgetAllocator& allocator = BudgetAllocator::install();
      const int64_t before = allocator.live_bytes();
      const CausalLM model(c, at::TensorOptions().dtype(at::kFloat), 7);
      const Pass p = one_pass(model, batch_for(c, b, t), Precision::fp32, policy, /*backward=*/false);
      live[layers - 2] = allocator.live_bytes() - before + p.kept;  // the model's weights and the forward's
    }
    return live[1] - live[0];
  };
  const int64_t ops = layer_bytes(CheckpointPolicy::ops());
  EXPECT_EQ(ops, layer_weights + input + rng + kept);
  EXPECT_EQ(layer_bytes(CheckpointPolicy::full()), layer_weights + input + rng);
  EXPECT_GT(layer_bytes(CheckpointPolicy::none()), ops);
}

// A training step with per-op checkpointing, as `headroom train` runs it (SmolLM-135M's widths, 6
// layers, 4 x 256 tokens, float32 AdamW, where the layers' activations outweigh the head's): its
// measured peak strictly between no checkpointing's and
// full checkpointing's, the same losses as without, and its estimate within 0.1% of the measured
// step (the accuracy grid holds more families and precisions to 1%).
TEST(OpCheckpoint, AStepPeaksBetweenFullAndNoCheckpointingAsEstimated) {
  auto run = [](const char* checkpointing) {
    RunConfig cfg;
    cfg.model = "smollm-135m";
    cfg.overrides = {"num_hidden_layers=6"};
    cfg.batch = 4;
    cfg.seq = 256;
    cfg.steps = 2;
    cfg.eval_rows = 0;
    cfg.quiet = true;
    cfg.device = "cpu";
    cfg.checkpointing = parse_checkpoint_policy(checkpointing);
    const TrainResult r = train(cfg);
    EXPECT_EQ(r.steps.size(), 2u);
    const Estimate e = estimate(load_model_config(cfg.model, cfg.overrides), train_spec(cfg));
    EXPECT_NEAR(static_cast<double>(e.step_peak()), static_cast<double>(r.steps.back().peak_bytes),
                1e-3 * static_cast<double>(r.steps.back().peak_bytes))
        << checkpointing;
    return std::pair{r.steps.back().peak_bytes, r.steps.back().loss};
  };
  const auto [none, none_loss] = run("none");
  const auto [ops, ops_loss] = run("ops");
  const auto [full, full_loss] = run("full");
  EXPECT_LT(ops, none);
  EXPECT_GT(ops, full);
  EXPECT_EQ(ops_loss, none_loss);
  std::printf("  step peaks: none %lld, ops %lld, full %lld\n", static_cast<long long>(none),
              static_cast<long long>(ops), static_cast<long long>(full));
}

}  // namespace
}  // namespace headroom
