#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "optim/optimizer.h"

namespace headroom {
namespace {

TEST(AdamW, TwoStepsMatchAHandComputedUpdate) {
  // p0 = [1, -2] (a matrix, so it decays), lr 0.1, betas (0.9, 0.95), eps 1e-8, weight decay 0.1;
  // grads [0.5, 0.1] then [-0.25, 0.1]. Expected values computed by hand from the AdamW paper's
  // update (decoupled decay, bias-corrected moments), independently of ATen.
  auto p = at::tensor({1.0f, -2.0f}).reshape({1, 2}).requires_grad_(true);
  std::vector<NamedTensor> params = {{"w", p}};
  auto opt = make_adamw(params, {0.9, 0.95, 1e-8, 0.1});
  p.mutable_grad() = at::tensor({0.5f, 0.1f}).reshape({1, 2});
  opt->step(0.1);
  EXPECT_NEAR(p[0][0].item<float>(), 0.890000002, 1e-6);
  EXPECT_NEAR(p[0][1].item<float>(), -2.07999999, 1e-6);
  p.mutable_grad() = at::tensor({-0.25f, 0.1f}).reshape({1, 2});
  opt->step(0.1);
  EXPECT_NEAR(p[0][0].item<float>(), 0.8542630578558273, 1e-6);
  EXPECT_NEAR(p[0][1].item<float>(), -2.159199980100002, 1e-6);
}

TEST(AdamW, StateIsTwoMomentsPerParameterAllocatedUpFront) {
  auto w = at::zeros({4, 8}).requires_grad_(true);
  auto b = at::zeros({8}).requires_grad_(true);
  auto opt = make_adamw({{"w", w}, {"b", b}}, {});
  // exp_avg + exp_avg_sq: 2 x 40 floats = 320 bytes, plus one float step counter per parameter.
  EXPECT_EQ(opt->state_bytes(), 2 * 40 * 4 + 2 * 4);
  EXPECT_EQ(opt->state().size(), 6u);
}

TEST(AdamW, VectorsAreNotDecayed) {
  auto b = at::ones({3}).requires_grad_(true);
  auto opt = make_adamw({{"b", b}}, {0.9, 0.95, 1e-8, 0.5});
  b.mutable_grad() = at::zeros({3});
  opt->step(1.0);
  EXPECT_TRUE(at::allclose(b, at::ones({3})));  // zero grad, no decay: unchanged
}

TEST(ClipGradNorm, ScalesToTheMaxNorm) {
  auto a = at::zeros({2}).requires_grad_(true);
  auto b = at::zeros({1}).requires_grad_(true);
  a.mutable_grad() = at::tensor({3.0f, 0.0f});
  b.mutable_grad() = at::tensor({4.0f});
  std::vector<NamedTensor> params = {{"a", a}, {"b", b}};
  EXPECT_NEAR(clip_grad_norm(params, 1.0), 5.0, 1e-6);  // sqrt(9 + 16)
  EXPECT_NEAR(a.grad()[0].item<float>(), 0.6, 1e-5);
  EXPECT_NEAR(b.grad()[0].item<float>(), 0.8, 1e-5);
  zero_grad(params);
  EXPECT_FALSE(a.grad().defined());
}

}  // namespace
}  // namespace headroom
