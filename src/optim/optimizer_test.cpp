#include "optim/optimizer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <array>
#include <barrier>
#include <thread>

#include "util/error.h"

namespace headroom {
namespace {

// Two steps of each optimizer on p0 = [[1, -2]] (a matrix, so weight decay applies) with gradients
// [0.5, 0.1] then [-0.25, 0.1] at lr 0.1. The expected values were computed by hand (plain Python
// floats) from each method's published update rule, independently of ATen.
struct HandComputed {
  OptimizerKind kind;
  double weight_decay;
  std::array<double, 2> after_first, after_second;
};

class TwoSteps : public ::testing::TestWithParam<HandComputed> {};

TEST_P(TwoSteps, MatchTheHandComputedUpdate) {
  const HandComputed& h = GetParam();
  auto p = at::tensor({1.0f, -2.0f}).reshape({1, 2}).requires_grad_(true);
  OptimizerOptions o;
  o.weight_decay = h.weight_decay;
  auto opt = make_optimizer(h.kind, {{"w", p}}, o);
  p.mutable_grad() = at::tensor({0.5f, 0.1f}).reshape({1, 2});
  opt->step(0.1);
  EXPECT_NEAR(p[0][0].item<float>(), h.after_first[0], 1e-6);
  EXPECT_NEAR(p[0][1].item<float>(), h.after_first[1], 1e-6);
  p.mutable_grad() = at::tensor({-0.25f, 0.1f}).reshape({1, 2});
  opt->step(0.1);
  EXPECT_NEAR(p[0][0].item<float>(), h.after_second[0], 1e-6);
  EXPECT_NEAR(p[0][1].item<float>(), h.after_second[1], 1e-6);
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, TwoSteps,
    ::testing::Values(
        // AdamW: decoupled decay 0.1, betas (0.9, 0.95), eps 1e-8, bias-corrected moments.
        HandComputed{OptimizerKind::adamw, 0.1, {0.890000002, -2.07999999}, {0.8542630578558273, -2.159199980100002}},
        // AdamW8bit: a parameter this small keeps float32 moments (bitsandbytes' min_8bit_size): AdamW's update.
        HandComputed{OptimizerKind::adamw8bit, 0.1, {0.890000002, -2.07999999}, {0.8542630578558273, -2.159199980100002}},
        // Adam: the same with L2 decay 0.1 added to the gradient.
        HandComputed{OptimizerKind::adam, 0.1, {0.9000000016666666, -1.900000009999999},
                     {0.8539362251824001, -1.8002805701248918}},
        // SGD with L2 decay 0.1: p -= lr * (g + 0.1 p).
        HandComputed{OptimizerKind::sgd, 0.1, {0.94, -1.99}, {0.9556, -1.9801}},
        // Momentum 0.9: buf = 0.9 buf + g; p -= lr * buf.
        HandComputed{OptimizerKind::momentum, 0.0, {0.95, -2.01}, {0.93, -2.029}},
        // Adagrad: sum += g^2; p -= lr * g / (sqrt(sum) + 1e-10).
        HandComputed{OptimizerKind::adagrad, 0.0, {0.9, -2.1}, {0.9447213595499958, -2.170710678118655}}),
    [](const auto& info) { return std::string(optimizer_name(info.param.kind)); });

TEST(Adafactor, TwoStepsOnAMatrixMatchTheHandComputedUpdate) {
  // 2x2, lr 0.01 (the relative step cap), eps2 1e-3, d 1, beta2 decay -0.8, no weight decay; the
  // factored second moment R C / mean(R), computed by hand in plain Python floats.
  auto p = at::tensor({1.0f, -2.0f, 0.5f, 3.0f}).reshape({2, 2}).requires_grad_(true);
  auto opt = make_optimizer(OptimizerKind::adafactor, {{"w", p}}, {});
  p.mutable_grad() = at::tensor({0.5f, 0.1f, -0.2f, 0.4f}).reshape({2, 2});
  opt->step(0.01);
  const double first[] = {0.9770075423770772, -2.0060060636259807, 0.5104861740577159, 2.9726081354082994};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(p.view({4})[i].item<float>(), first[i], 2e-6) << i;
  p.mutable_grad() = at::tensor({-0.25f, 0.1f, 0.3f, -0.1f}).reshape({2, 2});
  opt->step(0.01);
  const double second[] = {0.9912121621673377, -2.0150199738138443, 0.49286771940188545, 2.9819250085020266};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(p.view({4})[i].item<float>(), second[i], 2e-6) << i;
}

// Three ranks (threads here) each update a 1-D slice of a 5x7 matrix and a 4-vector, as
// dist/data_parallel.h hands them out: slices of ceil(n / 3) elements that start and end inside
// rows, and none of the vector for the last rank. Summing their parts of the statistics must give
// each rank its slice of what one process computes on the whole parameters.
TEST(Adafactor, ShardedSlicesStepAsTheWholeParameters) {
  constexpr int kRanks = 3;
  at::manual_seed(3);
  const at::Tensor w0 = at::randn({5, 7}, at::TensorOptions().dtype(at::kFloat)), v0 = at::randn({4});
  std::vector<std::array<at::Tensor, 2>> grads;
  for (int step = 0; step < 3; ++step) grads.push_back({at::randn({5, 7}), at::randn({4})});
  OptimizerOptions o;
  o.weight_decay = 0.1;

  auto w = w0.clone().requires_grad_(true), v = v0.clone().requires_grad_(true);
  auto alone = make_optimizer(OptimizerKind::adafactor, {{"w", w}, {"v", v}}, o);
  for (const auto& g : grads) {
    w.mutable_grad() = g[0];
    v.mutable_grad() = g[1];
    alone->step(0.05);
  }

  // The ranks' sum: each puts its tensor up, all add the same parts in rank order, then write.
  std::barrier sync(kRanks);
  std::array<at::Tensor, kRanks> shared;
  auto sum = [&](int rank, at::Tensor& t) {
    shared[static_cast<size_t>(rank)] = t;
    sync.arrive_and_wait();
    at::Tensor total = shared[0].clone();
    for (size_t k = 1; k < kRanks; ++k) total += shared[k];
    sync.arrive_and_wait();
    t.copy_(total);
  };
  auto slice = [](int64_t n, int rank) {
    const int64_t c = (n + kRanks - 1) / kRanks, start = std::min(rank * c, n);
    return std::make_pair(start, std::min(c, n - start));
  };
  std::array<at::Tensor, kRanks> ws, vs;
  std::array<std::vector<NamedTensor>, kRanks> states;
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      const auto [ws_start, ws_len] = slice(35, r);
      const auto [vs_start, vs_len] = slice(4, r);
      OptimizerOptions mine = o;
      mine.sharding = OptimizerSharding{{{"w", {5, 7}, ws_start, ws_len}, {"v", {4}, vs_start, vs_len}},
                                        [&sum, r](at::Tensor& t) { sum(r, t); }};
      auto& wr = ws[static_cast<size_t>(r)];
      auto& vr = vs[static_cast<size_t>(r)];
      wr = w0.reshape(-1).narrow(0, ws_start, ws_len).clone().requires_grad_(true);
      vr = v0.narrow(0, vs_start, vs_len).clone().requires_grad_(true);
      std::vector<NamedTensor> params = {{"w", wr}};
      if (vs_len > 0) params.push_back({"v", vr});
      auto opt = make_optimizer(OptimizerKind::adafactor, params, mine);
      for (const auto& g : grads) {
        wr.mutable_grad() = g[0].reshape(-1).narrow(0, ws_start, ws_len).clone();
        if (vs_len > 0) vr.mutable_grad() = g[1].narrow(0, vs_start, vs_len).clone();
        opt->step(0.05);
      }
      states[static_cast<size_t>(r)] = opt->state();
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(vs[2].numel(), 0);  // the last rank holds none of the vector
  EXPECT_TRUE(at::allclose(at::cat({ws[0], ws[1], ws[2]}), w.detach().reshape(-1), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(at::cat({vs[0], vs[1], vs[2]}), v.detach(), 1e-5, 1e-6));
  EXPECT_FALSE(at::allclose(w.detach(), w0));  // the steps moved it
  // The factored moments are whole on every rank, the same; the vector's moment is the rank's slice.
  auto find = [](const std::vector<NamedTensor>& list, const std::string& name) {
    for (const auto& t : list) {
      if (t.name == name) return t.tensor;
    }
    return at::Tensor();
  };
  for (int r = 0; r < kRanks; ++r) {
    const auto& st = states[static_cast<size_t>(r)];
    EXPECT_TRUE(at::equal(find(st, "w.row_var"), find(states[0], "w.row_var"))) << r;
    EXPECT_TRUE(at::allclose(find(st, "w.row_var"), find(alone->state(), "w.row_var"), 1e-5, 1e-7)) << r;
    EXPECT_TRUE(at::allclose(find(st, "w.col_var"), find(alone->state(), "w.col_var"), 1e-5, 1e-7)) << r;
    EXPECT_EQ(find(st, "w.step").item<float>(), 3.0f);
    EXPECT_EQ(find(st, "v.variance").defined(), r < 2) << r;
  }
  EXPECT_TRUE(alone->whole_parameter_state("w.row_var"));
  EXPECT_FALSE(alone->whole_parameter_state("v.variance"));
}

TEST(Optimizers, StateSizesAreWhatEachMethodHolds) {
  // A 4x8 matrix and an 8-vector: 40 parameters, 160 bytes in float32; a step counter is 4 bytes.
  auto make = [](OptimizerKind k) {
    auto w = at::zeros({4, 8}).requires_grad_(true);
    auto b = at::zeros({8}).requires_grad_(true);
    return make_optimizer(k, {{"w", w}, {"b", b}}, {});
  };
  EXPECT_EQ(make(OptimizerKind::sgd)->state_bytes(), 0);
  EXPECT_EQ(make(OptimizerKind::momentum)->state_bytes(), 160);
  EXPECT_EQ(make(OptimizerKind::adam)->state_bytes(), 2 * 160 + 2 * 4);
  EXPECT_EQ(make(OptimizerKind::adamw)->state_bytes(), 2 * 160 + 2 * 4);  // the same state as adam
  EXPECT_EQ(make(OptimizerKind::adagrad)->state_bytes(), 160 + 2 * 4);
  // adafactor: rows (4) + columns (8) for the matrix, the full 8 for the vector, two counters.
  EXPECT_EQ(make(OptimizerKind::adafactor)->state_bytes(), (4 + 8) * 4 + 8 * 4 + 2 * 4);
  EXPECT_EQ(make(OptimizerKind::adafactor)->working_memory()[0].numel(), 32);  // the largest parameter
}

TEST(Optimizers, EachParameterKeepsItsOwnStepCount) {
  // b takes three steps alone, then a and b one together: a's bias correction is that of step 1,
  // b's that of step 4 (as torch.optim counts), whatever order they sit in.
  for (auto kind : {OptimizerKind::adam, OptimizerKind::adamw, OptimizerKind::adagrad}) {
    auto a = at::zeros({2, 2}).requires_grad_(true);
    auto b = at::zeros({2, 2}).requires_grad_(true);
    auto opt = make_optimizer(kind, {{"a", a}, {"b", b}}, {});
    for (int i = 0; i < 3; ++i) {
      b.mutable_grad() = at::ones({2, 2});
      opt->step(0.1);
    }
    a.mutable_grad() = at::ones({2, 2});
    b.mutable_grad() = at::ones({2, 2});
    opt->step(0.1);
    for (const auto& s : opt->state()) {
      if (s.name == "a.step") {
        EXPECT_EQ(s.tensor.item<float>(), 1.0f) << optimizer_name(kind);
      }
      if (s.name == "b.step") {
        EXPECT_EQ(s.tensor.item<float>(), 4.0f) << optimizer_name(kind);
      }
    }
  }
}

TEST(Adafactor, RunsOnPureBf16AndVectors) {
  auto w = at::ones({4, 3}, at::kBFloat16).requires_grad_(true);
  auto v = at::ones({3}, at::kBFloat16).requires_grad_(true);
  OptimizerOptions o;
  o.weight_decay = 0.1;
  auto opt = make_optimizer(OptimizerKind::adafactor, {{"w", w}, {"v", v}}, o);
  w.mutable_grad() = at::full({4, 3}, 0.5, at::kBFloat16);
  v.mutable_grad() = at::full({3}, -0.5, at::kBFloat16);
  opt->step(0.01);
  EXPECT_TRUE(w.isfinite().all().item<bool>());
  EXPECT_LT(w[0][0].item<float>(), 1.0f);  // moved against the gradient
  EXPECT_GT(v[0].item<float>(), 1.0f);
}

TEST(Optimizers, VectorsAreNotDecayed) {
  for (auto k : {OptimizerKind::sgd, OptimizerKind::adam, OptimizerKind::adamw, OptimizerKind::adagrad}) {
    auto b = at::ones({3}).requires_grad_(true);
    OptimizerOptions o;
    o.weight_decay = 0.5;
    auto opt = make_optimizer(k, {{"b", b}}, o);
    b.mutable_grad() = at::zeros({3});
    opt->step(1.0);
    EXPECT_TRUE(at::allclose(b, at::ones({3}))) << optimizer_name(k);  // zero grad, no decay: unchanged
  }
}

TEST(Optimizers, UnknownNameIsAnError) {
  EXPECT_THROW(parse_optimizer("lion"), Error);
  EXPECT_EQ(parse_optimizer("adafactor"), OptimizerKind::adafactor);
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
