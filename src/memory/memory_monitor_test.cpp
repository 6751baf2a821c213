#include "memory/memory_monitor.h"
#include "util/tensor_bytes.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

namespace headroom {
namespace {

TEST(MemoryMonitor, PhasePeaksAreExactAndResetPerPhase) {
  auto probe = make_memory_probe(at::kCPU);
  std::vector<at::Tensor> weights = {at::empty({100}, at::kFloat)};  // 400 bytes
  MemoryMonitor monitor(*probe, {[&] { return weights; }, [] { return std::vector<at::Tensor>{}; },
                                 [] { return std::vector<at::Tensor>{}; }});
  monitor.begin_step(0);
  const int64_t base = probe->live_bytes();
  at::Tensor kept;
  {
    auto s = monitor.phase(Phase::forward);
    auto transient = at::empty({1000}, at::kFloat);  // 4000 bytes, freed inside the phase
    kept = at::empty({250}, at::kFloat);             // 1000 bytes, survives it
  }
  {
    auto s = monitor.phase(Phase::backward);
    auto transient = at::empty({10}, at::kFloat);  // 40 bytes
  }
  const StepMemory m = monitor.end_step();
  const PhaseMemory& fwd = m.phases[1];
  const PhaseMemory& bwd = m.phases[2];
  EXPECT_EQ(fwd.live_in, base);
  EXPECT_EQ(fwd.peak, base + 5000);
  EXPECT_EQ(fwd.live_out, base + 1000);
  EXPECT_EQ(bwd.peak, base + 1040);  // its own peak, not forward's
  EXPECT_EQ(m.peak, base + 5000);
  EXPECT_EQ(m.peak_phase, Phase::forward);
  EXPECT_EQ(fwd.at_peak.weights, 400);
  EXPECT_EQ(fwd.at_peak.gradients, 0);
  EXPECT_EQ(fwd.at_peak.activations, 5000);  // the transient and the kept tensor, both live at the peak
  EXPECT_EQ(bwd.at_peak.activations, 1040);
  EXPECT_FALSE(m.phases[0].seen);  // no data phase ran
}

TEST(MemoryMonitor, GradientsCountOnlyFromWhenTheyExist) {
  auto probe = make_memory_probe(at::kCPU);
  at::Tensor grad;
  MemoryMonitor monitor(*probe, {[] { return std::vector<at::Tensor>{}; },
                                 [&] { return grad.defined() ? std::vector<at::Tensor>{grad} : std::vector<at::Tensor>{}; },
                                 [] { return std::vector<at::Tensor>{}; }});
  monitor.begin_step(0);
  {
    auto s = monitor.phase(Phase::backward);
    { auto early_peak = at::empty({10000}, at::kFloat); }  // 40 KB peak before any gradient
    grad = at::empty({100}, at::kFloat);                   // 400 bytes after it
  }
  const StepMemory m = monitor.end_step();
  EXPECT_EQ(m.phases[2].at_peak.gradients, 0);
  EXPECT_EQ(m.phases[2].at_peak.activations, 40000);
}

TEST(StorageBytes, SharedStorageCountsOnce) {
  auto t = at::empty({10, 10}, at::kFloat);
  EXPECT_EQ(storage_bytes({t, t.view({100}), t.narrow(0, 0, 2), at::Tensor()}), 400);
}

}  // namespace
}  // namespace headroom
