#include "memory/budget_allocator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

namespace headroom {
namespace {

TEST(BudgetAllocator, CountsExactlyTheBytesOfKnownTensors) {
  auto& a = BudgetAllocator::install();
  const int64_t before = a.live_bytes();
  a.reset_peak();
  {
    auto x = at::empty({1000}, at::kFloat);   // 4000 bytes
    auto y = at::empty({10, 10}, at::kLong);  // 800 bytes
    EXPECT_EQ(a.live_bytes() - before, 4800);
    EXPECT_EQ(a.peak_bytes() - before, 4800);
  }
  EXPECT_EQ(a.live_bytes(), before);
  EXPECT_EQ(a.peak_bytes() - before, 4800);  // the peak remembers
  a.reset_peak();
  EXPECT_EQ(a.peak_bytes(), before);
}

TEST(BudgetAllocator, RefusesAnAllocationPastTheBudget) {
  auto& a = BudgetAllocator::install();
  const int64_t before = a.live_bytes();
  a.set_budget(before + 1'000'000);
  auto ok = at::empty({200'000}, at::kFloat);  // 800,000 bytes fit
  try {
    auto too_much = at::empty({100'000}, at::kFloat);  // 400,000 more do not
    ADD_FAILURE() << "no OOM";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("Tried to allocate 391 KiB"));
  }
  EXPECT_EQ(a.live_bytes() - before, 800'000);  // the refused one took nothing
  a.set_budget(std::nullopt);
  auto now_ok = at::empty({100'000}, at::kFloat);
  EXPECT_EQ(a.live_bytes() - before, 1'200'000);
}

}  // namespace
}  // namespace headroom
