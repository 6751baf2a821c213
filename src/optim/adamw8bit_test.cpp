// AdamW with 8-bit states: the dynamic map's shape, nearest-value quantisation, the state's bytes
// against the formula worked out by hand, and the update against float32 AdamW's on the same
// gradients.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "optim/optimizer.h"
#include "optim/quantize8bit.h"

namespace headroom {
namespace {

int count_in(const std::array<float, 256>& map, double lo, double hi) {
  return static_cast<int>(std::count_if(map.begin(), map.end(), [&](float v) { return v >= lo && v < hi; }));
}

// Seven decades, 2^i values in decade i (twice as many unsigned), 0 and 1: 256 values ascending.
TEST(DynamicMap, HoldsTheDecadesOfTheDynamicType) {
  const auto& s = dynamic_map(true);
  const auto& u = dynamic_map(false);
  EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));
  EXPECT_TRUE(std::is_sorted(u.begin(), u.end()));
  EXPECT_EQ(s.back(), 1.0F);
  EXPECT_EQ(u.back(), 1.0F);
  EXPECT_EQ(u.front(), 0.0F);
  EXPECT_EQ(std::count(s.begin(), s.end(), 0.0F), 1);
  // The signed map's most negative value: the midpoint of decade 0's last interval, [0.9859375, 1].
  EXPECT_NEAR(s.front(), -0.99296875, 1e-7);
  for (int decade = 0; decade < 7; ++decade) {
    const double lo = std::pow(10.0, decade - 6) * 0.1, hi = std::pow(10.0, decade - 6);
    EXPECT_EQ(count_in(s, lo, hi), 1 << decade) << decade;
    EXPECT_EQ(count_in(s, -hi, -lo + 1e-12), 1 << decade) << decade;
    EXPECT_EQ(count_in(u, lo, hi), 2 << decade) << decade;
  }
}

TEST(DynamicMap, QuantisesToTheNearestValue) {
  const auto& map = dynamic_map(true);
  const at::Tensor xs = at::rand({2000}, at::TensorOptions().dtype(at::kFloat)) * 2 - 1;
  for (int64_t i = 0; i < xs.numel(); ++i) {
    const float x = xs[i].item<float>();
    const float got = map[quantize_nearest(map, x)];
    float best = 2;
    for (float v : map) best = std::min(best, std::abs(v - x));
    EXPECT_EQ(std::abs(got - x), best) << x;
  }
}

// The formula: per parameter of n >= 4096 elements, 2n bytes of codes and two float32 absmaxes per
// block of 2048; below 4096, two float32 moments (8n); and a 4-byte step counter each.
TEST(AdamW8bit, StateBytesAreTheFormulas) {
  auto w = at::zeros({64, 128}).requires_grad_(true);  // 8192: 4 blocks
  auto v = at::zeros({5000}).requires_grad_(true);      // 3 blocks, the last partial
  auto b = at::zeros({10}).requires_grad_(true);        // float32 moments
  const auto opt = make_optimizer(OptimizerKind::adamw8bit, {{"w", w}, {"v", v}, {"b", b}}, {});
  EXPECT_EQ(opt->state_bytes(), (2 * 8192 + 2 * 4 * 4 + 4) + (2 * 5000 + 2 * 4 * 3 + 4) + (8 * 10 + 4));
  const auto adamw = make_optimizer(OptimizerKind::adamw, {{"w", w}, {"v", v}, {"b", b}}, {});
  EXPECT_LT(opt->state_bytes() * 3, adamw->state_bytes());  // about 2 bytes per parameter instead of 8
}

// 100 steps on the same gradients: the 8-bit update moves the parameter as float32 AdamW does, to
// within a few percent of how far it moved; in float32 parameters, and in bf16 ones (at a larger
// learning rate, so that bf16 does not round the steps themselves away).
TEST(AdamW8bit, FollowsFloat32AdamW) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(3);
    const at::Tensor start = at::randn({96, 128}).to(dtype);
    auto p8 = start.clone().requires_grad_(true), p32 = start.clone().requires_grad_(true);
    OptimizerOptions o;
    o.weight_decay = 0.1;
    const auto eight = make_optimizer(OptimizerKind::adamw8bit, {{"w", p8}}, o);
    const auto full = make_optimizer(OptimizerKind::adamw, {{"w", p32}}, o);
    const at::Tensor direction = at::randn({96, 128});
    for (int step = 0; step < 100; ++step) {
      // A consistent direction under noise, at scales that vary across columns (and so within and
      // across blocks), as a model's gradients are.
      const at::Tensor g = ((direction + at::randn({96, 128})) * at::linspace(0.01, 1, 128)).to(dtype);
      p8.mutable_grad() = g.clone();
      p32.mutable_grad() = g.clone();
      // bf16 parameters round away updates below 2^-8 of themselves: a larger step for them.
      const double lr = dtype == at::kFloat ? 1e-3 : 1e-2;
      eight->step(lr);
      full->step(lr);
    }
    const at::Tensor moved = (p32.to(at::kFloat) - start.to(at::kFloat));
    const double deviation = (p8.to(at::kFloat) - p32.to(at::kFloat)).norm().item<double>() / moved.norm().item<double>();
    std::printf("  %s: moved %.3f, 8-bit's deviation from it %.4f\n", c10::toString(dtype),
                moved.norm().item<double>(), deviation);
    EXPECT_LT(deviation, 0.05) << c10::toString(dtype);
    EXPECT_GT(moved.norm().item<double>(), 5.0);  // it moved
  }
}

}  // namespace
}  // namespace headroom
