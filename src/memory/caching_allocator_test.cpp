// The cpu caching allocator: LibTorch's tensors served from CachingHeap segments through the
// BudgetAllocator, with the budget on reserved bytes. Expected figures are worked out from the
// policy's rules by hand (memory/caching_policy.h), or measured by a separate replay.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <unordered_map>

#include "estimate/reserved.h"
#include "memory/budget_allocator.h"

namespace headroom {
namespace {

constexpr int64_t MiB = 1024 * 1024;

at::Tensor bytes(int64_t n) { return at::empty({n}, at::kByte); }

// Back to the counting allocator and no budget, however the test ends.
struct CachingScope {
  explicit CachingScope(const AllocatorConfig& c = {}) : a(BudgetAllocator::install()) { a.use_caching(c); }
  ~CachingScope() {
    a.set_budget(std::nullopt);
    a.record_history(0);
    a.use_caching(std::nullopt);
  }
  BudgetAllocator& a;
};

TEST(CachingAllocator, ServesTensorsFromSegmentsAndKeepsThemCached) {
  CachingScope s;
  const int64_t live = s.a.live_bytes();
  {
    at::Tensor x = at::empty({1000}, at::kFloat);  // 4000 bytes: a 4096-byte block in a 2 MiB segment
    at::Tensor y = bytes(3 * MiB);                 // large: a 20 MiB segment
    x.fill_(2);
    y.fill_(1);
    EXPECT_EQ(x.sum().item<float>(), 2000.0f);
    EXPECT_EQ(y[3 * MiB - 1].item<uint8_t>(), 1);  // the memory is real
    const CachingStats st = *s.a.caching_stats();
    EXPECT_EQ(st.reserved_bytes.current, 22 * MiB);
    EXPECT_EQ(st.requested_bytes.current, 4000 + 3 * MiB);
    EXPECT_GE(st.allocated_bytes.current, 4096 + 3 * MiB);
    EXPECT_EQ(s.a.live_bytes() - live, 4000 + 3 * MiB);  // live bytes stay what tensors asked for
  }
  EXPECT_EQ(s.a.caching_stats()->reserved_bytes.current, 22 * MiB);  // freed, still cached
  EXPECT_EQ(s.a.caching_stats()->allocated_bytes.current, 0);
  s.a.empty_cache();
  EXPECT_EQ(s.a.caching_stats()->reserved_bytes.current, 0);
}

TEST(CachingAllocator, TheBudgetCapsReservedBytesSoFragmentationCanFailARequestLiveBytesWouldAllow) {
  CachingScope s;
  s.a.set_budget(100 * MiB);
  bytes(50 * MiB);                   // a 50 MiB segment, then cached
  at::Tensor kept = bytes(20 * MiB);  // cut from it: 30 MiB free behind a live block
  try {
    bytes(60 * MiB);  // 20 + 60 live would fit 100; 50 + 60 reserved do not, and nothing can be freed
    ADD_FAILURE() << "no OOM";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("30.0 MiB is reserved by PyTorch but unallocated"));
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("expandable_segments:True"));
  }
  const auto oom = s.a.last_oom();
  ASSERT_TRUE(oom && oom->caching);
  EXPECT_EQ(oom->caching->reserved, 50 * MiB);
  EXPECT_EQ(oom->caching->allocated, 20 * MiB);
  EXPECT_EQ(s.a.caching_stats()->num_ooms, 1);
  EXPECT_EQ(s.a.caching_stats()->num_alloc_retries, 1);
  EXPECT_EQ(s.a.caching_stats()->inactive_split_bytes.current, 30 * MiB);
}

TEST(CachingAllocator, ExpandableSegmentsServeTheSameSequenceUnderTheSameBudget) {
  AllocatorConfig c;
  c.expandable_segments = true;
  CachingScope s(c);
  s.a.set_budget(100 * MiB);
  bytes(50 * MiB);  // three 20 MiB pages mapped
  at::Tensor kept = bytes(20 * MiB);
  // 60 reserved + 60 > 100: the cache is released (the free pages behind the live block unmapped),
  // and the retry maps [20, 80): 80 MiB mapped.
  at::Tensor big = bytes(60 * MiB);
  big.fill_(7);
  EXPECT_EQ(big[60 * MiB - 1].item<uint8_t>(), 7);
  EXPECT_EQ(s.a.caching_stats()->reserved_bytes.current, 80 * MiB);
  EXPECT_EQ(s.a.caching_stats()->num_ooms, 0);
}

TEST(CachingAllocator, BlocksOfAnEarlierHeapStayValidAfterASwitch) {
  auto& a = BudgetAllocator::install();
  a.use_caching(AllocatorConfig{});
  at::Tensor x = bytes(5 * MiB);
  a.use_caching(std::nullopt);  // back to counting: x's heap is retired, not unmapped
  at::Tensor y = bytes(MiB);
  x.fill_(3);
  EXPECT_EQ(x[5 * MiB - 1].item<uint8_t>(), 3);
  x.reset();  // the retired heap's last block: it goes now
}

// The allocator's own history, replayed by the estimator's replay (estimate/reserved.h) as the
// estimator's allocation sequence: the same requests and frees in the same order give the same
// segments exactly — the property the estimator's prediction of reserved bytes rests on.
TEST(CachingAllocator, TheEstimatorsReplayOfItsHistoryGivesTheSamePeakReservedExactly) {
  CachingScope s;
  s.a.record_history(1'000'000);
  std::mt19937 rng(7);
  std::vector<at::Tensor> live;
  for (int i = 0; i < 600; ++i) {
    const int64_t size = rng() % 3 == 0 ? 1 + static_cast<int64_t>(rng() % (30 * MiB))
                                        : 1 + static_cast<int64_t>(rng() % (900 * 1024));
    live.push_back(bytes(size));
    if (live.size() > 12) live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
  }
  live.clear();
  const CachingStats measured = *s.a.caching_stats();
  std::vector<sim::Memory::Event> events;
  std::unordered_map<uint64_t, int> id_of;  // the history's address -> a buffer id, as the sim numbers them
  for (const HistoryEntry& h : s.a.history()) {
    if (h.event.action == TraceAction::alloc) {
      id_of[h.event.address] = static_cast<int>(events.size());
      events.push_back({static_cast<int>(events.size()), h.event.size, true});
    } else if (h.event.action == TraceAction::free_requested) {
      events.push_back({id_of.at(h.event.address), 0, false});
    }
  }
  EXPECT_EQ(events.size(), 1200u);  // 600 allocations, all freed
  const ReservedReplay replay = replay_reserved(events, events.size(), 0, AllocatorConfig{});
  EXPECT_GT(measured.reserved_bytes.peak, 30 * MiB);
  EXPECT_EQ(replay.peak_reserved, measured.reserved_bytes.peak);
  EXPECT_EQ(replay.peak_allocated, measured.allocated_bytes.peak);
  EXPECT_EQ(replay.peak_inactive_split, measured.inactive_split_bytes.peak);
  EXPECT_EQ(replay.segments, measured.segment.current);
}

}  // namespace
}  // namespace headroom
