// The test programs' bf16/fp16 cpu matmul (reduced_precision_matmul.cpp) must not change what the
// suite measures: its result and nothing more from the allocator (what LibTorch's own kernel
// allocates on a cpu without oneDNN's path for the dtype), and its products rounded once from float32.
#include <ATen/ATen.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>

#include "memory/budget_allocator.h"

namespace headroom {
namespace {

// The allocator's peak above what was live, while f runs and its result is held.
int64_t peak_of(const std::function<at::Tensor()>& f) {
  BudgetAllocator& a = BudgetAllocator::install();
  const int64_t before = a.live_bytes();
  a.reset_peak();
  const at::Tensor out = f();
  return a.peak_bytes() - before;
}

// The product allocates its result and nothing else through c10, as LibTorch's own kernel does on a
// cpu without a oneDNN path for the dtype (its scalar fallback). Where oneDNN runs it (AVX-512 BF16,
// AMX), LibTorch's kernel also takes scratch for packing; the suite measures without it, and the
// estimator counts none.
void expect_only_the_result(int64_t product, int64_t libtorch, int64_t result_bytes, at::ScalarType dtype) {
  EXPECT_EQ(product, result_bytes) << dtype;
  EXPECT_GE(libtorch, result_bytes) << dtype;
}

TEST(ReducedPrecisionMatmul, AllocatesWhatLibTorchsKernelDoesAndRoundsOnce) {
  // The registrations are the cpu kernels the dispatcher calls.
  for (const auto& [name, overload] : {std::pair{"aten::mm", ""}, {"aten::mm", "out"}, {"aten::addmm", ""}}) {
    const std::string state = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).dumpState();
    EXPECT_NE(state.find("reduced_precision_matmul.cpp"), std::string::npos) << name << "." << overload;
  }
  at::manual_seed(3);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const auto options = at::TensorOptions().dtype(dtype);
    const at::Tensor g = at::randn({24, 320}, options), w = at::randn({320, 48}, options);
    const at::Tensor bias = at::randn({48}, options);
    // A linear's input gradient (untransposed), its forward (the weight transposed) and with a bias.
    for (const at::Tensor& b : {w, w.t().contiguous().t()}) {
      // The float32 product in b's own layout, as the registration reads it.
      const at::Tensor exact = at::mm(g.to(at::kFloat), b.to(at::kFloat)).to(dtype);
      EXPECT_TRUE(at::equal(at::mm(g, b), exact)) << dtype;
      const int64_t result_bytes = 24 * 48 * static_cast<int64_t>(c10::elementSize(dtype));
      expect_only_the_result(peak_of([&] { return at::mm(g, b); }), peak_of([&] { return at::cpu::mm(g, b); }),
                             result_bytes, dtype);
      at::Tensor out = at::empty({24, 48}, options);
      at::mm_out(out, g, b);
      EXPECT_TRUE(at::equal(out, exact)) << dtype;

      const at::Tensor exact_addmm =
          at::addmm(bias.to(at::kFloat), g.to(at::kFloat), b.to(at::kFloat), 0.5, 2).to(dtype);
      EXPECT_TRUE(at::equal(at::addmm(bias, g, b, 0.5, 2), exact_addmm)) << dtype;
      expect_only_the_result(peak_of([&] { return at::addmm(bias, g, b); }),
                             peak_of([&] { return at::cpu::addmm(bias, g, b); }), result_bytes, dtype);
      // LibTorch's kernel agrees to its own rounding.
      EXPECT_TRUE(at::allclose(at::cpu::mm(g, b).to(at::kFloat), exact.to(at::kFloat), 2e-2, 0.5)) << dtype;
    }
  }
}

}  // namespace
}  // namespace headroom
