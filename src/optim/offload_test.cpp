// Optimizer offload: the update equals the same optimizer's on the device, bit for bit; the state and
// the host copies are in the host pool, at the bytes worked out by hand, and nothing of them on the
// device; a parameter changed behind the optimizer's back (a checkpoint loaded) is taken up.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "memory/budget_allocator.h"
#include "optim/offload.h"
#include "optim/optimizer.h"
#include "util/error.h"

namespace headroom {
namespace {

std::vector<NamedTensor> parameters(at::ScalarType dtype) {
  at::manual_seed(7);
  const auto o = at::TensorOptions().dtype(dtype);
  return {{"layers.0.w", at::randn({64, 128}, o).requires_grad_(true)},
          {"layers.0.b", at::randn({10}, o).requires_grad_(true)}};
}

// Both parameter sets get the same gradients, step by step.
void set_gradients(const std::vector<NamedTensor>& a, const std::vector<NamedTensor>& b, int step) {
  at::manual_seed(100 + step);
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor g = at::randn(a[i].tensor.sizes(), a[i].tensor.options());
    a[i].tensor.mutable_grad() = g.clone();
    b[i].tensor.mutable_grad() = g.clone();
  }
}

class OffloadMatches : public ::testing::TestWithParam<std::pair<OptimizerKind, at::ScalarType>> {};

TEST_P(OffloadMatches, TheOptimizerOnTheDevice) {
  const auto [kind, dtype] = GetParam();
  const auto device = parameters(dtype), host = parameters(dtype);
  OptimizerOptions options;
  options.weight_decay = 0.1;
  const auto plain = make_optimizer(kind, device, options);
  const auto offloaded = make_offloaded_optimizer(kind, host, options);
  EXPECT_TRUE(offloaded->offloaded());
  for (int step = 0; step < 3; ++step) {
    set_gradients(device, host, step);
    plain->step(1e-2);
    offloaded->step(1e-2);
  }
  for (size_t i = 0; i < device.size(); ++i) {
    EXPECT_TRUE(at::equal(device[i].tensor, host[i].tensor)) << device[i].name;
  }
  std::map<std::string, at::Tensor> expected;
  for (const NamedTensor& s : plain->state()) expected[s.name] = s.tensor;
  const auto got = offloaded->state();
  ASSERT_EQ(got.size(), expected.size());
  for (const NamedTensor& s : got) {
    ASSERT_TRUE(expected.count(s.name)) << s.name;
    EXPECT_TRUE(at::equal(expected[s.name], s.tensor)) << s.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, OffloadMatches,
                         ::testing::Values(std::pair{OptimizerKind::adamw, at::kFloat},
                                           std::pair{OptimizerKind::adamw, at::kBFloat16},
                                           std::pair{OptimizerKind::adamw8bit, at::kFloat},
                                           std::pair{OptimizerKind::momentum, at::kFloat},
                                           std::pair{OptimizerKind::adafactor, at::kBFloat16}));

// float32 AdamW over 8,192 + 10 elements: host copies and gradient buffers 4 B each per element,
// two float32 moments 8 B, and a 4-byte step counter per tensor; the device holds none of it, and
// the step allocates nothing there.
TEST(Offload, HoldsStateAndCopiesInTheHostPool) {
  auto& a = BudgetAllocator::install();
  const auto params = parameters(at::kFloat);
  const int64_t n = 64 * 128 + 10;
  const int64_t live = a.live_bytes(), host = a.host_live_bytes();
  const auto opt = make_offloaded_optimizer(OptimizerKind::adamw, params, {});
  EXPECT_EQ(a.live_bytes(), live);
  EXPECT_EQ(a.host_live_bytes() - host, 4 * n + 4 * n + 8 * n + 2 * 4);
  for (const NamedTensor& p : params) p.tensor.mutable_grad() = at::ones_like(p.tensor);
  const int64_t with_grads = a.live_bytes();
  a.reset_peak();
  opt->step(1e-3);
  EXPECT_EQ(a.peak_bytes(), with_grads);
  EXPECT_EQ(a.host_peak_bytes() - host, 4 * n + 4 * n + 8 * n + 2 * 4);
}

// After a step, the parameter is overwritten (as a checkpoint load does); a step with a zero
// learning rate must leave the new values, not the host copy's old ones.
TEST(Offload, TakesUpAParameterChangedOutside) {
  const auto params = parameters(at::kFloat);
  const auto opt = make_offloaded_optimizer(OptimizerKind::adamw, params, {});
  for (const NamedTensor& p : params) p.tensor.mutable_grad() = at::ones_like(p.tensor);
  opt->step(1e-2);
  const at::Tensor loaded = at::full({64, 128}, 0.5);
  {
    c10::NoGradGuard no_grad;
    params[0].tensor.copy_(loaded);
  }
  opt->step(0.0);
  EXPECT_TRUE(at::equal(params[0].tensor, loaded));
}

TEST(Offload, RefusesShardedState) {
  const auto params = parameters(at::kFloat);
  OptimizerOptions options;
  options.sharding.emplace();
  EXPECT_THROW(make_offloaded_optimizer(OptimizerKind::adamw, params, options), Error);
}

}  // namespace
}  // namespace headroom
