#include "memory/budget_allocator.h"

#include "memory/host_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <malloc.h>
#if HEADROOM_WITH_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#include <algorithm>
#include <atomic>
#include <thread>

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

// Tagged allocations (a collective's buffers, gathered weights): what any thread allocates under a
// tag is counted apart by tag until freed, and the peak remembers how much of each was live then.
TEST(BudgetAllocator, CountsTaggedAllocationsApartAndAtThePeak) {
  using enum AllocationTag;
  auto& a = BudgetAllocator::install();
  const TaggedBytes before = a.tagged_bytes();
  auto comm = [&](const TaggedBytes& t) { return t[communication] - before[communication]; };
  auto gathered = [&](const TaggedBytes& t) { return t[gathered_weights] - before[gathered_weights]; };
  a.reset_peak();
  auto plain = at::empty({250}, at::kFloat);  // 1000 bytes, untagged
  a.set_tag(gathered_weights);
  auto layer = at::empty({500}, at::kFloat);  // 2000
  a.set_tag(communication);
  auto bucket = at::empty({1000}, at::kFloat);  // 4000
  at::Tensor worker;
  std::thread([&] { worker = at::empty({100}, at::kDouble); }).join();  // 800, another thread's
  a.set_tag(none);
  EXPECT_EQ(comm(a.tagged_bytes()), 4800);
  EXPECT_EQ(gathered(a.tagged_bytes()), 2000);
  EXPECT_EQ(comm(a.peak_tagged_bytes()), 4800);
  bucket.reset();
  layer.reset();
  EXPECT_EQ(comm(a.tagged_bytes()), 800);
  EXPECT_EQ(gathered(a.tagged_bytes()), 0);
  auto after = at::empty({2000}, at::kFloat);  // 8000: a new peak, with only the worker's 800 tagged
  EXPECT_EQ(comm(a.peak_tagged_bytes()), 800);
  EXPECT_EQ(gathered(a.peak_tagged_bytes()), 0);
  worker.reset();  // freed after the tag changed: still taken off
  EXPECT_EQ(comm(a.tagged_bytes()), 0);
}

// The host pool (optimizer offload): what is allocated under a HostPoolScope is counted apart, with
// its own peak, passes a full device budget, is not among the device's allocations, and is taken off
// the host count when freed, whatever the pool is then.
TEST(BudgetAllocator, CountsTheHostPoolApartFromTheDevice) {
  auto& a = BudgetAllocator::install();
  const int64_t live = a.live_bytes(), host = a.host_live_bytes();
  const size_t records = a.live_allocations().size();
  a.reset_peak();
  a.set_budget(live + 1000);
  at::Tensor state, scratch;
  {
    HostPoolScope scope;
    state = at::empty({25'000}, at::kFloat);  // 100,000 bytes: 100x the device's room
    {
      HostPoolScope nested;
      scratch = at::empty({500}, at::kDouble);  // 4,000
    }
    auto still_host = at::empty({10}, at::kFloat);  // the nested scope restored the host pool: 40 more
    EXPECT_EQ(a.host_live_bytes() - host, 104'040);
  }
  auto device = at::empty({100}, at::kFloat);  // 400 bytes, on the device again
  a.set_budget(std::nullopt);
  EXPECT_EQ(a.live_bytes() - live, 400);
  EXPECT_EQ(a.peak_bytes() - live, 400);
  EXPECT_EQ(a.host_live_bytes() - host, 104'000);
  EXPECT_EQ(a.host_peak_bytes() - host, 104'040);
  EXPECT_EQ(a.live_allocations().size(), records + 1);
  scratch.reset();
  EXPECT_EQ(a.host_live_bytes() - host, 100'000);
  a.reset_peak();
  EXPECT_EQ(a.host_peak_bytes() - host, 100'000);
  state.reset();
  EXPECT_EQ(a.host_live_bytes(), host);
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

TEST(BudgetAllocator, FaultInjectionFailsTheNthAllocationOnce) {
  auto& a = BudgetAllocator::install();
  for (int round = 0; round < 2; ++round) {  // the same arming gives the same failure
    a.fail_nth_allocation(3);
    auto t1 = at::empty({10}, at::kFloat);
    auto t2 = at::empty({20}, at::kFloat);
    try {
      auto t3 = at::empty({30}, at::kFloat);
      ADD_FAILURE() << "the third allocation did not fail";
    } catch (const c10::OutOfMemoryError& e) {
      EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("injected fault"));
      ASSERT_TRUE(a.last_oom().has_value());
      EXPECT_TRUE(a.last_oom()->injected);
      EXPECT_EQ(a.last_oom()->requested, 120);
    }
    auto t4 = at::empty({30}, at::kFloat);  // one-shot: disarmed after firing
  }
}

TEST(BudgetAllocator, FaultInjectionBySize) {
  auto& a = BudgetAllocator::install();
  a.fail_allocation_above(1000);
  auto small = at::empty({250}, at::kFloat);  // exactly 1000 bytes: not above
  EXPECT_THROW(at::empty({251}, at::kFloat), c10::OutOfMemoryError);
  auto after = at::empty({251}, at::kFloat);
}

TEST(BudgetAllocator, RecordsTagStepPhaseAndSizeClass) {
  auto& a = BudgetAllocator::install();
  const auto before = a.size_histogram();
  a.set_context(6, Phase::backward);
  auto t = at::empty({3000}, at::kByte);  // 3000 bytes: size class (2048, 4096] = entry 12
  a.set_context(-1, Phase::idle);
  auto rec = a.record_of(t.data_ptr());
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(rec->bytes, 3000);
  EXPECT_EQ(rec->step, 6);
  EXPECT_EQ(rec->phase, Phase::backward);
  EXPECT_EQ(rec->frames, 0);  // backtraces off by default
  EXPECT_EQ(a.size_histogram()[12] - before[12], 1);
  const auto live = a.live_allocations();
  EXPECT_TRUE(std::any_of(live.begin(), live.end(), [&](const LiveAllocation& l) { return l.ptr == t.data_ptr(); }));
  try {
    a.set_budget(a.live_bytes());
    a.set_context(2, Phase::forward);
    auto no = at::empty({10}, at::kFloat);
    ADD_FAILURE() << "a full budget accepted 40 bytes";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("during forward of step 3"));
  }
  a.set_budget(std::nullopt);
  a.set_context(-1, Phase::idle);
}

TEST(BudgetAllocator, ConcurrentAllocationsNeverPassTheBudget) {
  // Four threads each take 1 MB under a 1.5 MB budget: at most one may hold it at a time.
  auto& a = BudgetAllocator::install();
  const int64_t base = a.live_bytes();
  a.set_budget(base + 1'500'000);
  std::atomic<int64_t> over{0}, granted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        try {
          auto x = at::empty({250'000}, at::kFloat);
          granted.fetch_add(1);
          if (a.live_bytes() > base + 1'500'000) over.fetch_add(1);
        } catch (const c10::OutOfMemoryError&) {
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  a.set_budget(std::nullopt);
  EXPECT_EQ(over.load(), 0);
  EXPECT_GT(granted.load(), 0);
  EXPECT_EQ(a.live_bytes(), base);
}

TEST(BudgetAllocator, BacktracesWhenAsked) {
  auto& a = BudgetAllocator::install();
  a.set_backtraces(true);
  auto t = at::empty({16}, at::kFloat);
  a.set_backtraces(false);
  EXPECT_GT(a.record_of(t.data_ptr())->frames, 3);
}

TEST(BudgetAllocator, AccountingOffPassesThrough) {
  auto& a = BudgetAllocator::install();
  const int64_t before = a.live_bytes();
  a.set_accounting(false);
  auto t = at::empty({1000}, at::kFloat);
  a.set_accounting(true);
  EXPECT_EQ(a.live_bytes(), before);
  EXPECT_FALSE(a.record_of(t.data_ptr()).has_value());
}

// What malloc has handed out: on this thread (jemalloc, the tests' malloc where it was found), or in
// glibc's main arena.
size_t heap_bytes() {
#if HEADROOM_WITH_JEMALLOC
  uint64_t allocated = 0;
  size_t size = sizeof(allocated);
  EXPECT_EQ(mallctl("thread.allocated", &allocated, &size, nullptr, 0), 0);
  return static_cast<size_t>(allocated);
#else
  return ::mallinfo2().uordblks;
#endif
}

// The gaps: memory that does not pass through LibTorch's CPU allocator is not counted.
TEST(BudgetAllocatorGaps, ForeignMemoryAndMetadataAreNotCounted) {
  auto& a = BudgetAllocator::install();
  const int64_t before = a.live_bytes();
  std::vector<float> foreign(100000);
  auto wrapped = at::from_blob(foreign.data(), {100000}, at::kFloat);  // 400 KB the caller owns
  EXPECT_EQ(a.live_bytes(), before);
  // Tensor metadata (TensorImpl, sizes, strides) lives on the C++ heap: malloc sees it, we do not.
  auto base = at::empty({4}, at::kFloat);
  const int64_t counted = a.live_bytes();
  const size_t heap_before = heap_bytes();
  std::vector<at::Tensor> views;
  for (int i = 0; i < 10000; ++i) views.push_back(base.view({2, 2}));
  const size_t heap_after = heap_bytes();
  EXPECT_EQ(a.live_bytes(), counted);
  EXPECT_GT(heap_after - heap_before, 10000u * 100);  // > 100 bytes a view
}

TEST(BudgetAllocatorGaps, CallersOfTheDefaultAllocatorBypassIt) {
  // Code that asks c10 for the *default* CPU allocator, rather than the current one, is not seen.
  // ATen's tensor factories use the current one (c10::GetCPUAllocator), as the tests above show.
  auto& a = BudgetAllocator::install();
  const int64_t before = a.live_bytes();
  c10::DataPtr raw = c10::GetDefaultCPUAllocator()->allocate(1 << 20);
  EXPECT_NE(raw.get(), nullptr);
  EXPECT_EQ(a.live_bytes(), before);
  EXPECT_EQ(c10::GetCPUAllocator(), &a);
}

}  // namespace
}  // namespace headroom
