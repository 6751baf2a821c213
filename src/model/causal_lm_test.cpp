#include "model/causal_lm.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "testing/test_models.h"

namespace headroom {
namespace {

// A forward without dropout on `path`.
ForwardOptions inference(AttentionPath path) {
  ForwardOptions o;
  o.attention = path;
  o.training = false;
  return o;
}

using testing::shrunk_models;
using testing::ShrunkModel;

const at::TensorOptions kCpu = at::TensorOptions().dtype(at::kFloat);

class EveryFamily : public ::testing::TestWithParam<ShrunkModel> {};

TEST_P(EveryFamily, LogitsHaveShapeBatchSeqVocab) {
  const ModelConfig c = GetParam().load();
  CausalLM model(c, kCpu, 1);
  auto ids = at::randint(0, 256, {3, 16}, at::TensorOptions().dtype(at::kLong));
  auto logits = model.forward(ids, inference(AttentionPath::flash));
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 16, c.vocab_size}));
  EXPECT_TRUE(logits.isfinite().all().item<bool>());
}

TEST_P(EveryFamily, BuiltModelCountsWhatTheConfigImplies) {
  const ModelConfig c = GetParam().load();
  CausalLM real(c, kCpu, 1);
  CausalLM meta(c, at::TensorOptions().device(at::kMeta), 1);
  EXPECT_EQ(real.num_parameters(), count_parameters(c));
  EXPECT_EQ(meta.num_parameters(), count_parameters(c));
}

TEST_P(EveryFamily, FlashAndMathAttentionAgree) {
  const ModelConfig c = GetParam().load();
  CausalLM model(c, kCpu, 2);
  auto ids = at::randint(0, 256, {2, 24}, at::TensorOptions().dtype(at::kLong));
  auto flash = model.forward(ids, inference(AttentionPath::flash));
  auto math = model.forward(ids, inference(AttentionPath::math));
  EXPECT_TRUE(at::allclose(flash, math, 1e-4, 1e-5)) << (flash - math).abs().max().item<float>();
}

TEST_P(EveryFamily, IsCausal) {
  // Changing the last token must leave every earlier position's logits unchanged.
  const ModelConfig c = GetParam().load();
  CausalLM model(c, kCpu, 3);
  auto ids = at::randint(0, 256, {1, 12}, at::TensorOptions().dtype(at::kLong));
  auto changed = ids.clone();
  changed[0][11] = (ids[0][11].item<int64_t>() + 1) % 256;
  for (auto path : {AttentionPath::flash, AttentionPath::math}) {
    auto a = model.forward(ids, inference(path));
    auto b = model.forward(changed, inference(path));
    if (!c.moe) {
      EXPECT_TRUE(at::equal(a.narrow(1, 0, 11), b.narrow(1, 0, 11)));
    } else {
      // Experts run on the rows routed to them: the changed token changes which rows an expert's
      // matmul holds, and so the order of its sums (not what reaches the earlier positions).
      EXPECT_TRUE(at::allclose(a.narrow(1, 0, 11), b.narrow(1, 0, 11), 1e-5, 1e-6))
          << (a.narrow(1, 0, 11) - b.narrow(1, 0, 11)).abs().max().item<float>();
    }
    EXPECT_FALSE(at::allclose(a.narrow(1, 11, 1), b.narrow(1, 11, 1)));
  }
}

TEST_P(EveryFamily, SameSeedSameWeights) {
  const ModelConfig c = GetParam().load();
  CausalLM a(c, kCpu, 7), b(c, kCpu, 7), other(c, kCpu, 8);
  for (size_t i = 0; i < a.parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(a.parameters()[i].tensor, b.parameters()[i].tensor));
  }
  EXPECT_FALSE(at::equal(a.parameters()[0].tensor, other.parameters()[0].tensor));
}

INSTANTIATE_TEST_SUITE_P(Families, EveryFamily, ::testing::ValuesIn(shrunk_models()),
                         [](const auto& info) { return info.param.label; });

TEST(CausalLM, SlidingWindowLimitsWhatAPositionSees) {
  // One layer, window 4: position t sees t-3..t, so token 0 reaches positions 0..3 only.
  auto c = load_model_config(
      "mistral-7b", {"hidden_size=32", "intermediate_size=64", "num_attention_heads=2", "num_key_value_heads=1",
                     "num_hidden_layers=1", "vocab_size=256", "head_dim=16", "sliding_window=4"});
  CausalLM model(c, kCpu, 4);
  auto ids = at::randint(0, 256, {1, 10}, at::TensorOptions().dtype(at::kLong));
  auto changed = ids.clone();
  changed[0][0] = (ids[0][0].item<int64_t>() + 1) % 256;
  for (auto path : {AttentionPath::flash, AttentionPath::math}) {
    auto a = model.forward(ids, inference(path));
    auto b = model.forward(changed, inference(path));
    EXPECT_FALSE(at::allclose(a.select(1, 3), b.select(1, 3)));
    EXPECT_TRUE(at::allclose(a.narrow(1, 4, 6), b.narrow(1, 4, 6), 1e-5, 1e-6));
  }
}

TEST(Rotary, ScoresDependOnRelativePositionOnly) {
  // RoPE's defining property: <R(m) q, R(n) k> depends on m - n alone.
  auto c = load_model_config("tiny");
  Rotary rotary(c);
  auto [cos, sin] = rotary.tables(16, at::kCPU);
  auto q = at::randn({1, 1, 1, c.head_dim}).expand({1, 1, 16, c.head_dim}).contiguous();
  auto k = at::randn({1, 1, 1, c.head_dim}).expand({1, 1, 16, c.head_dim}).contiguous();
  auto rq = rotary.apply(q, cos, sin)[0][0];
  auto rk = rotary.apply(k, cos, sin)[0][0];
  const float d_3_1 = (rq[3] * rk[1]).sum().item<float>();
  const float d_9_7 = (rq[9] * rk[7]).sum().item<float>();
  const float d_3_0 = (rq[3] * rk[0]).sum().item<float>();
  EXPECT_NEAR(d_3_1, d_9_7, 1e-4);
  EXPECT_GT(std::abs(d_3_1 - d_3_0), 1e-4);
  EXPECT_TRUE(at::allclose(rq[0], q[0][0][0]));  // position 0: no rotation
}

TEST(Rotary, Llama3ScalingMatchesItsDefinition) {
  // Llama 3.2 1B: theta 500000, factor 32, low 1, high 4, original 8192. Check three regimes by hand:
  // the first frequency (wavelength 2*pi < 2048: kept), the last (wavelength > 8192: divided by 32).
  auto c = load_model_config("llama-3.2-1b");
  Rotary rotary(c);
  const auto& f = rotary.inverse_frequencies();
  ASSERT_EQ(f.size(), 32u);
  EXPECT_DOUBLE_EQ(f[0], 1.0);
  const double last = 1.0 / std::pow(500000.0, 62.0 / 64.0);
  EXPECT_NEAR(f[31], last / 32.0, last * 1e-12);
  // A medium band entry blends: between f/32 and f.
  const double mid = 1.0 / std::pow(500000.0, 2.0 * 12 / 64.0);  // wavelength ~ 2*pi*500000^(24/64) ~ 853
  EXPECT_DOUBLE_EQ(f[12], mid);                                  // 853 < 2048: still high frequency
  // Entry 16: wavelength ~4443, inside (2048, 8192): smooth = (8192 / wavelength - 1) / (4 - 1).
  const double f16 = 1.0 / std::pow(500000.0, 32.0 / 64.0);
  const double smooth = (8192.0 / (2 * M_PI / f16) - 1.0) / 3.0;
  EXPECT_NEAR(f[16], (1 - smooth) * f16 / 32 + smooth * f16, f16 * 1e-12);
}

}  // namespace
}  // namespace headroom
