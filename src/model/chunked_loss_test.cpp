// The chunked loss (model/chunked_loss.h) against the full head and token_loss on the same model
// and batch: the loss and every parameter's gradient after one backward, at real widths and
// vocabularies (depth shrunk), tied and untied heads, in float32 and under bf16 autocast.
#include "model/chunked_loss.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "util/error.h"
#include "device/autocast_adapter.h"
#include "model/causal_lm.h"
#include "train/precision.h"
#include "train/step_ops.h"

namespace headroom {
namespace {

struct Grads {
  double loss = 0;
  std::vector<at::Tensor> grads;
};

Grads one_backward(const CausalLM& model, const at::Tensor& batch, Precision precision, const LossSetting& loss) {
  const at::Tensor inputs = batch.narrow(1, 0, batch.size(1) - 1), targets = batch.narrow(1, 1, batch.size(1) - 1);
  at::Tensor l;
  {
    const AutocastScope autocast(c10::DeviceType::CPU, forward_autocast(precision));
    l = model_loss(model, inputs, targets, ForwardOptions{}, loss);
  }
  l.backward();
  Grads g;
  g.loss = l.item<double>();
  for (const NamedTensor& p : model.parameters()) {
    g.grads.push_back(p.tensor.grad().clone());
    p.tensor.mutable_grad() = at::Tensor();
  }
  return g;
}

struct Case {
  std::string model;
  std::vector<std::string> overrides;
  Precision precision;
  int64_t rows, seq, chunk;
  double tolerance;  // |chunked - full| / |full|, for the loss and each parameter's gradient
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << (c.overrides.size() > 1 ? " " + c.overrides[1] : "") << " " << precision_name(c.precision);
}

void expect_matches(const Case& k) {
  const ModelConfig c = load_model_config(k.model, k.overrides);
  const CausalLM model(c, at::TensorOptions().dtype(at::kFloat), 7);
  at::manual_seed(3);
  const at::Tensor batch = at::randint(c.vocab_size, {k.rows, k.seq + 1}, at::TensorOptions().dtype(at::kLong));
  const Grads full = one_backward(model, batch, k.precision, LossSetting{});
  const Grads chunked = one_backward(model, batch, k.precision, LossSetting{true, k.chunk});
  EXPECT_NEAR(chunked.loss, full.loss, 1e-5 * std::abs(full.loss));
  ASSERT_EQ(chunked.grads.size(), full.grads.size());
  double worst = 0;
  for (size_t i = 0; i < full.grads.size(); ++i) {
    const std::string& name = model.parameters()[i].name;
    const double norm = full.grads[i].norm().item<double>();
    const double diff = (chunked.grads[i] - full.grads[i]).norm().item<double>();
    ASSERT_GT(norm, 0) << name;
    worst = std::max(worst, diff / norm);
    EXPECT_LT(diff / norm, k.tolerance) << name << ": |chunked - full| / |full| = " << diff / norm;
  }
  std::printf("  loss %.8f vs %.8f; largest gradient difference %.3g of its norm\n", chunked.loss, full.loss, worst);
}

// float32: the same arithmetic in another order, within 1e-5.
class ChunkedLossMatches : public ::testing::TestWithParam<Case> {};

TEST_P(ChunkedLossMatches, TheFullLossAndItsGradients) { expect_matches(GetParam()); }

INSTANTIATE_TEST_SUITE_P(
    RealVocabularies, ChunkedLossMatches,
    ::testing::Values(Case{"qwen3-0.6b", {"num_hidden_layers=1"}, Precision::fp32, 2, 32, 24, 1e-5},
                      Case{"qwen3-0.6b", {"num_hidden_layers=1", "tie_word_embeddings=false"}, Precision::fp32, 2, 32,
                           24, 1e-5},
                      Case{"gemma-3-1b", {"num_hidden_layers=1"}, Precision::fp32, 2, 32, 24, 1e-5}));

// bf16-mixed: the loss within 1e-5; the gradients within one bf16 rounding (2^-8 of a value). The
// head's matmuls round their bf16 results per call, and the cpu's bf16 kernels round differently by
// shape (the full path's own gradients move by as much when the batch is split in two), so the
// chunks' matmuls cannot reproduce the whole batch's bits. (Slow tier: the cpu's bf16 matmul over a
// 151,936-long reduction takes tens of seconds.)
TEST(ChunkedLossBf16, WithinOneRoundingOfTheFullGradients) {
  expect_matches(Case{"qwen3-0.6b", {"num_hidden_layers=1", "tie_word_embeddings=false"}, Precision::bf16_mixed, 2, 8,
                      6, 1e-2});
}

// The default chunk: tokens / ceil(vocab / hidden), to the nearest power of two, within [256, tokens].
TEST(ChunkedLoss, DefaultChunkFollowsVocabularyOverWidth) {
  EXPECT_EQ(chunk_tokens(LossSetting{true, 0}, 8192, 151936, 1024), 256);     // 8192 / 149 = 54.98 -> 64 -> 256
  EXPECT_EQ(chunk_tokens(LossSetting{true, 0}, 1 << 17, 262144, 1152), 512);  // 131072 / 228 = 574.9 -> 512
  EXPECT_EQ(chunk_tokens(LossSetting{true, 0}, 10, 151936, 1024), 10);
  EXPECT_EQ(chunk_tokens(LossSetting{true, 0}, 100, 64, 128), 100);  // nearest power 128, capped at the tokens
  EXPECT_EQ(chunk_tokens(LossSetting{true, 500}, 256, 151936, 1024), 256);
  EXPECT_EQ(parse_loss("chunked:1024").chunk, 1024);
  EXPECT_EQ(parse_loss("full"), LossSetting{});
  EXPECT_THROW(parse_loss("chunked:0"), Error);
  EXPECT_THROW(parse_loss("chunky"), Error);
}

}  // namespace
}  // namespace headroom
