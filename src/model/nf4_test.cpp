// NF4: the code against QLoRA's published table, quantisation to the nearest code value in blocks of
// 64 with the packing bitsandbytes uses, the bytes a weight takes, and nf4_linear against a dense
// linear layer over the same dequantised weight (forward, and the input's gradient).
#include "model/nf4.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "memory/budget_allocator.h"

namespace headroom {
namespace {

// The 16 values as QLoRA's paper and bitsandbytes list them (Dettmers et al. 2023, appendix E).
TEST(Nf4, CodeIsQloraNormalFloat) {
  const double published[16] = {-1.0,
                                -0.6961928009986877,
                                -0.5250730514526367,
                                -0.39491748809814453,
                                -0.28444138169288635,
                                -0.18477343022823334,
                                -0.09105003625154495,
                                0.0,
                                0.07958029955625534,
                                0.16093020141124725,
                                0.24611230194568634,
                                0.33791524171829224,
                                0.44070982933044434,
                                0.5626170039176941,
                                0.7229568362236023,
                                1.0};
  const auto& code = nf4_code();
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(code[static_cast<size_t>(i)], published[i], 2e-7) << i;
}

Nf4Weight empty_weight(std::vector<int64_t> sizes) {
  Nf4Weight w;
  w.sizes = sizes;
  w.codes = at::empty({nf4_code_bytes(w.numel())}, at::kByte);
  w.absmax = at::empty({nf4_blocks(w.numel())}, at::kFloat);
  return w;
}

// A block's largest magnitude is its absmax; the first value of a pair is the high half of the byte.
TEST(Nf4, PacksTwoIndicesToAByteHighFirst) {
  at::Tensor dense = at::zeros({2, 64});
  dense[0][0] = 2.0;   // the absmax of block 0: code 15
  dense[0][1] = -2.0;  // code 0
  dense[0][2] = 0.16;  // 0.08 of the absmax: nearest 0.0796, code 8
  dense[1][0] = -0.5;  // block 1, its absmax: code 0; the rest 0, code 7
  Nf4Weight w = empty_weight({2, 64});
  nf4_quantise_into(dense, w);
  EXPECT_EQ(w.absmax[0].item<float>(), 2.0F);
  EXPECT_EQ(w.absmax[1].item<float>(), 0.5F);
  EXPECT_EQ(w.codes[0].item<uint8_t>(), 0xF0);
  EXPECT_EQ(w.codes[1].item<uint8_t>(), 0x87);
  EXPECT_EQ(w.codes[2].item<uint8_t>(), 0x77);
  EXPECT_EQ(w.codes[32].item<uint8_t>(), 0x07);
}

// Every value comes back as the nearest code value times its block's absmax; the weight takes n/2
// bytes and 4 per block of 64, allocated once, and dequantising allocates only its result.
TEST(Nf4, QuantisesToTheNearestValueAndTakesHalfAByte) {
  at::manual_seed(3);
  const at::Tensor dense = at::randn({96, 128}, at::kBFloat16) * 0.02;
  auto& a = BudgetAllocator::install();
  const int64_t before = a.live_bytes();
  Nf4Weight w = empty_weight({96, 128});
  EXPECT_EQ(a.live_bytes() - before, 96 * 128 / 2 + 4 * (96 * 128 / 64));
  a.reset_peak();
  nf4_quantise_into(dense, w);
  EXPECT_EQ(a.peak_bytes() - before, 96 * 128 / 2 + 4 * (96 * 128 / 64)) << "quantising allocates nothing";
  const at::Tensor back = nf4_dequantise(w, at::kFloat);
  EXPECT_EQ(a.peak_bytes() - before, 96 * 128 / 2 + 4 * (96 * 128 / 64) + 96 * 128 * 4);
  const auto& code = nf4_code();
  const at::Tensor flat = dense.to(at::kFloat).reshape(-1), got = back.reshape(-1);
  for (int64_t i = 0; i < flat.numel(); ++i) {
    const float m = w.absmax[i / 64].item<float>(), x = flat[i].item<float>();
    float best = 0, gap = 3;
    for (float c : code) {
      if (std::abs(c * m - x) < gap) {
        gap = std::abs(c * m - x);
        best = c * m;
      }
    }
    ASSERT_FLOAT_EQ(got[i].item<float>(), best) << i;
  }
}

// nf4_linear is linear() over the dequantised weight: the same output and input gradient, and no
// gradient for the frozen weight.
TEST(Nf4, LinearIsTheDenseLayerOverTheDequantisedWeight) {
  at::manual_seed(4);
  Nf4Weight w = empty_weight({48, 64});
  nf4_quantise_into(at::randn({48, 64}), w);
  const at::Tensor bias = at::randn({48});
  const at::Tensor x = at::randn({2, 5, 64}).requires_grad_(true);
  const at::Tensor y = nf4_linear(x, w, bias);
  const at::Tensor g = at::randn({2, 5, 48});
  y.backward(g);
  const at::Tensor x2 = x.detach().clone().requires_grad_(true);
  const at::Tensor y2 = at::linear(x2, nf4_dequantise(w, at::kFloat), bias);
  y2.backward(g);
  EXPECT_TRUE(at::allclose(y, y2, 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(x.grad(), x2.grad(), 1e-6, 1e-6));
  EXPECT_FALSE(w.codes.grad().defined());
}

}  // namespace
}  // namespace headroom
