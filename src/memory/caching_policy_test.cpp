// The caching allocator's rules, one test each. Every expected figure is worked out by hand from
// the rule (in the comments), not taken from the policy's output.
#include "memory/caching_policy.h"

#include <c10/core/AllocatorConfig.h>
#include <gtest/gtest.h>

#include <map>

#include "util/error.h"

namespace headroom {
namespace {

constexpr int64_t KiB = 1024;
constexpr int64_t MiB = 1024 * 1024;

AllocatorConfig conf(const std::string& text) { return parse_allocator_config(text, "test"); }

TEST(CachingPolicy, SizesRoundUpTo512Bytes) {
  CachingPolicy p;
  EXPECT_EQ(p.round_size(0), 512);
  EXPECT_EQ(p.round_size(1), 512);
  EXPECT_EQ(p.round_size(512), 512);
  EXPECT_EQ(p.round_size(513), 1024);
  EXPECT_EQ(p.round_size(5 * MiB + 1), 5 * MiB + 512);
}

TEST(CachingPolicy, RoundupPower2DivisionsSplitEachPowerOfTwoIntoEqualSteps) {
  CachingPolicy four(conf("roundup_power2_divisions:4"));
  // Between 4 and 8 MiB, four steps of 1 MiB: 5 MiB + 1 goes to 6 MiB; a power of two stays.
  EXPECT_EQ(four.round_size(5 * MiB + 1), 6 * MiB);
  EXPECT_EQ(four.round_size(8 * MiB), 8 * MiB);
  EXPECT_EQ(four.round_size(6 * MiB), 6 * MiB);
  // Sizes no larger than 512 × divisions keep plain 512-byte rounding: 1200 → 1536.
  EXPECT_EQ(four.round_size(1200), 1536);
  // Per range: up to 512 MiB (the first key's 1 also below it) 1 division, 512 MiB-1 GiB 2,
  // 1-2 GiB 8, and none above the last key.
  CachingPolicy ranges(conf("roundup_power2_divisions:[256:1,512:2,1024:8]"));
  EXPECT_EQ(ranges.round_size(300 * MiB + 1), 300 * MiB + 512);    // 1 division: plain rounding
  EXPECT_EQ(ranges.round_size(600 * MiB + 1), 768 * MiB);          // 512 + 512 / 2
  EXPECT_EQ(ranges.round_size(1024 * MiB + 1), 1152 * MiB);        // 1024 + 1024 / 8
  EXPECT_EQ(ranges.round_size(2048 * MiB + 1), 2048 * MiB + 512);  // no key: plain rounding
  EXPECT_EQ(ranges.round_size(10 * MiB + 1), 10 * MiB + 512);      // below the first key: its 1
}

TEST(CachingPolicy, SmallRequestsShareTwoMiBSegmentsLargeOnesGetTheirOwn) {
  // ≤ 1 MiB: the small pool, 2 MiB segments. < 10 MiB: a 20 MiB segment. Else rounded up to 2 MiB.
  EXPECT_EQ(CachingPolicy::allocation_size(1 * MiB), 2 * MiB);
  EXPECT_EQ(CachingPolicy::allocation_size(1 * MiB + 512), 20 * MiB);
  EXPECT_EQ(CachingPolicy::allocation_size(10 * MiB - 512), 20 * MiB);
  EXPECT_EQ(CachingPolicy::allocation_size(10 * MiB), 10 * MiB);
  EXPECT_EQ(CachingPolicy::allocation_size(11 * MiB + 512), 12 * MiB);

  CachingPolicy p;
  const auto a = p.allocate(1000);  // small: a 2 MiB segment, split (1024 used, the rest ≥ 512 bytes)
  EXPECT_EQ(p.stats().reserved_bytes.current, 2 * MiB);
  EXPECT_EQ(p.stats().allocated_bytes.current, 1024);
  EXPECT_EQ(p.stats().requested_bytes.current, 1000);
  EXPECT_EQ(p.stats().inactive_split_bytes.current, 2 * MiB - 1024);
  const auto b = p.allocate(1 * MiB);  // also small: fits in the first segment's 2 MiB - 1 KiB
  EXPECT_EQ(p.stats().reserved_bytes.current, 2 * MiB);
  EXPECT_EQ(*b, *a + 1024);  // right after the first block
  p.allocate(1 * MiB + 1);   // large: its own 20 MiB segment
  EXPECT_EQ(p.stats().reserved_bytes.current, 22 * MiB);
  EXPECT_EQ(p.stats().segment.current, 2);
}

TEST(CachingPolicy, TheSmallestFreeBlockThatFitsServesTheRequest) {
  CachingPolicy p;
  const auto a = p.allocate(12 * MiB);  // a 12 MiB segment
  const auto b = p.allocate(16 * MiB);  // a 16 MiB segment
  const auto c = p.allocate(14 * MiB);  // a 14 MiB segment
  p.free(*a);
  p.free(*b);
  p.free(*c);
  // 11 MiB fits 12, 14 and 16: the 12 MiB block serves it, unsplit (1 MiB left is not more than 1 MiB),
  // so the whole block counts as allocated.
  const auto d = p.allocate(11 * MiB);
  EXPECT_EQ(*d, *a);
  EXPECT_EQ(p.stats().allocated_bytes.current, 12 * MiB);
  EXPECT_EQ(p.stats().reserved_bytes.current, 42 * MiB);
  const auto e = p.allocate(13 * MiB);  // now 14 is the smallest that fits
  EXPECT_EQ(*e, *c);
}

TEST(CachingPolicy, LargeBlocksSplitOnlyWhenMoreThanOneMiBRemains) {
  CachingPolicy p;
  p.allocate(5 * MiB);  // a 20 MiB segment: 15 MiB remain, split
  EXPECT_EQ(p.stats().allocated_bytes.current, 5 * MiB);
  EXPECT_EQ(p.stats().inactive_split_bytes.current, 15 * MiB);
  EXPECT_EQ(p.stats().inactive_split.current, 1);
  // 14 MiB + 512 from the 15 MiB block: 1 MiB - 512 would remain, not more than 1 MiB: not split.
  p.allocate(14 * MiB + 512);
  EXPECT_EQ(p.stats().allocated_bytes.current, 20 * MiB);
  EXPECT_EQ(p.stats().inactive_split_bytes.current, 0);
  EXPECT_EQ(p.stats().reserved_bytes.current, 20 * MiB);
  // 19 MiB + 1 rounds to 19 MiB + 512, in a segment rounded to 2 MiB: 20 MiB, nothing split off.
  CachingPolicy q;
  q.allocate(19 * MiB + 1);
  EXPECT_EQ(q.stats().reserved_bytes.current, 20 * MiB);
  EXPECT_EQ(q.stats().allocated_bytes.current, 20 * MiB);
  EXPECT_EQ(q.stats().requested_bytes.current, 19 * MiB + 1);
}

TEST(CachingPolicy, FreedBlocksMergeWithFreeNeighbours) {
  CachingPolicy p;
  const auto a = p.allocate(KiB), b = p.allocate(KiB), c = p.allocate(KiB);
  // [a 1K][b 1K][c 1K][rest 2M-3K]: one inactive split block.
  EXPECT_EQ(p.stats().inactive_split.current, 1);
  EXPECT_EQ(p.stats().inactive_split_bytes.current, 2 * MiB - 3 * KiB);
  p.free(*b);  // between two live blocks: a second free block
  EXPECT_EQ(p.stats().inactive_split.current, 2);
  EXPECT_EQ(p.stats().inactive_split_bytes.current, 2 * MiB - 2 * KiB);
  p.free(*a);  // merges with b: still two free blocks, 2 KiB and the rest
  EXPECT_EQ(p.stats().inactive_split.current, 2);
  EXPECT_EQ(p.stats().inactive_split_bytes.current, 2 * MiB - 1 * KiB);
  p.free(*c);  // joins both: the segment is whole again, no longer split
  EXPECT_EQ(p.stats().inactive_split.current, 0);
  EXPECT_EQ(p.stats().inactive_split_bytes.current, 0);
  EXPECT_EQ(p.stats().reserved_bytes.current, 2 * MiB);
  EXPECT_EQ(p.largest_free_block(), 2 * MiB);
  const auto segments = p.segments();
  ASSERT_EQ(segments.size(), 1u);
  EXPECT_EQ(segments[0].blocks.size(), 1u);
  p.empty_cache();
  EXPECT_EQ(p.stats().reserved_bytes.current, 0);
  EXPECT_EQ(p.stats().num_device_free, 1);
}

TEST(CachingPolicy, MaxSplitSizeKeepsOversizeBlocksWhole) {
  CachingPolicy p(conf("max_split_size_mb:40"));
  const auto a = p.allocate(50 * MiB);
  p.free(*a);
  // A 30 MiB request is below 40 MiB: the oversize 50 MiB block may not serve it; a new segment.
  const auto b = p.allocate(30 * MiB);
  EXPECT_NE(*b, *a);
  EXPECT_EQ(p.stats().reserved_bytes.current, 80 * MiB);
  // 45 MiB is oversize too, and 50 < 45 + 20: served by the 50 MiB block, unsplit.
  const auto c = p.allocate(45 * MiB);
  EXPECT_EQ(*c, *a);
  EXPECT_EQ(p.stats().allocated_bytes.current, 80 * MiB);
  // A cached block at least 20 MiB (max_non_split_rounding_mb) larger than an oversize request is
  // refused too.
  CachingPolicy q(conf("max_split_size_mb:40"));
  const auto big = q.allocate(80 * MiB);
  q.free(*big);
  q.allocate(45 * MiB);  // 80 ≥ 45 + 20: refused, a new 46 MiB segment (45 MiB rounded up to 2 MiB)
  EXPECT_EQ(q.stats().reserved_bytes.current, 126 * MiB);
}

TEST(CachingPolicy, AFailedSegmentFreesTheCacheAndRetriesThenRaises) {
  CachingPolicy p(AllocatorConfig{}, 60 * MiB);
  const auto a = p.allocate(30 * MiB);
  p.free(*a);  // 30 MiB cached
  // 40 MiB: no cached block fits; 30 + 40 > 60, so the cache is freed and the segment retried.
  ASSERT_TRUE(p.allocate(40 * MiB));
  EXPECT_EQ(p.stats().reserved_bytes.current, 40 * MiB);
  EXPECT_EQ(p.stats().num_alloc_retries, 1);
  EXPECT_EQ(p.stats().num_ooms, 0);
  // 30 MiB more: 40 + 30 > 60 with nothing cached: a retry, then out of memory.
  EXPECT_FALSE(p.allocate(30 * MiB));
  EXPECT_EQ(p.stats().num_alloc_retries, 2);
  EXPECT_EQ(p.stats().num_ooms, 1);
  ASSERT_TRUE(p.last_oom());
  EXPECT_EQ(p.last_oom()->requested, 30 * MiB);
  EXPECT_EQ(p.last_oom()->reserved, 40 * MiB);
  EXPECT_EQ(p.last_oom()->limit, 60 * MiB);
}

TEST(CachingPolicy, WithMaxSplitSizeOversizeBlocksAreFreedBeforeTheWholeCache) {
  CachingPolicy p(conf("max_split_size_mb:40"), 100 * MiB);
  const auto a = p.allocate(50 * MiB), b = p.allocate(48 * MiB);
  p.free(*a);
  p.free(*b);
  // 30 MiB: both cached blocks are oversize; 98 + 30 > 100. The smallest oversize block of at least
  // 40 MiB (48) is freed alone, and the segment fits: 50 + 30 = 80, without a retry.
  ASSERT_TRUE(p.allocate(30 * MiB));
  EXPECT_EQ(p.stats().reserved_bytes.current, 80 * MiB);
  EXPECT_EQ(p.stats().num_alloc_retries, 0);
}

TEST(CachingPolicy, GarbageCollectionFreesTheOldestCachedBlocksFirst) {
  // Cap 100 MiB, threshold 0.5: above 50 MiB reserved, a request that needs a new segment first
  // frees unsplit cached blocks at least as old (in large-pool searches) as their average.
  CachingPolicy p(conf("garbage_collection_threshold:0.5"), 100 * MiB);
  const auto a = p.allocate(12 * MiB);  // search 1
  const auto e = p.allocate(16 * MiB);  // search 2
  p.free(*a);                           // A cached at search 2
  p.allocate(16 * MiB);                 // search 3: 28 reserved ≤ 50, no collection; 44 reserved
  p.free(*e);                           // E cached at search 3
  p.allocate(18 * MiB);                 // search 4: 44 ≤ 50; 62 reserved
  // Search 5 needs 24 MiB: 62 > 50, 12 MiB to reclaim. Ages: A 3, E 2, average 2.5: A goes (12 MiB,
  // enough); E stays. 62 - 12 + 24 = 74.
  p.allocate(24 * MiB);
  EXPECT_EQ(p.stats().reserved_bytes.current, 74 * MiB);
  // Without collection both stay cached: 62 + 24 = 86.
  CachingPolicy q(AllocatorConfig{}, 100 * MiB);
  const auto qa = q.allocate(12 * MiB), qe = q.allocate(16 * MiB);
  q.free(*qa);
  q.allocate(16 * MiB);
  q.free(*qe);
  q.allocate(18 * MiB);
  q.allocate(24 * MiB);
  EXPECT_EQ(q.stats().reserved_bytes.current, 86 * MiB);
}

TEST(CachingPolicy, ExpandableSegmentsReturnFreePagesSoSplitTailsDoNotStrandMemory) {
  // Fixed segments: a 50 MiB segment reused for 20 MiB keeps 30 MiB free behind a live block. A
  // 60 MiB request under a 100 MiB cap: 50 + 60 > 100, and the segment cannot be freed (split):
  // out of memory with 20 MiB allocated.
  CachingPolicy fixed(AllocatorConfig{}, 100 * MiB);
  fixed.free(*fixed.allocate(50 * MiB));
  fixed.allocate(20 * MiB);
  EXPECT_FALSE(fixed.allocate(60 * MiB));
  EXPECT_EQ(fixed.stats().allocated_bytes.current, 20 * MiB);
  EXPECT_EQ(fixed.stats().reserved_bytes.current, 50 * MiB);
  EXPECT_EQ(fixed.stats().inactive_split_bytes.current, 30 * MiB);
  // Expandable: 50 MiB maps three 20 MiB pages (60). Freed, 20 MiB is cut from the front, leaving
  // [20, 60) free. 60 MiB: no free block is large enough, and the cap check on its segment size
  // fails (60 reserved + 60 > 100), so the cache is released — the two whole free pages [20, 60)
  // are unmapped, which fixed segments could not do with a live block in them — and the retry maps
  // [20, 80): 80 MiB in all, under the cap.
  CachingPolicy grow(conf("expandable_segments:True"), 100 * MiB);
  const auto a = grow.allocate(50 * MiB);
  EXPECT_EQ(grow.stats().reserved_bytes.current, 60 * MiB);
  grow.free(*a);
  const auto b = grow.allocate(20 * MiB);
  EXPECT_EQ(*b, *a);
  const auto c = grow.allocate(60 * MiB);
  ASSERT_TRUE(c);
  EXPECT_EQ(*c, *a + 20 * MiB);
  EXPECT_EQ(grow.stats().reserved_bytes.current, 80 * MiB);
  EXPECT_EQ(grow.stats().num_alloc_retries, 1);
  EXPECT_EQ(grow.stats().num_device_free, 1);  // the one unmapping of [20, 60)
  EXPECT_EQ(grow.stats().inactive_split_bytes.current, 0);  // not counted for expandable segments
  // empty_cache unmaps whole free pages only: after freeing c, [20, 80) is free: three pages.
  grow.free(*c);
  grow.empty_cache();
  EXPECT_EQ(grow.stats().reserved_bytes.current, 20 * MiB);
  grow.free(*b);
  grow.empty_cache();
  EXPECT_EQ(grow.stats().reserved_bytes.current, 0);
}

TEST(CachingPolicy, ExpandableSmallPoolMapsTwoMiBPages) {
  CachingPolicy p(conf("expandable_segments:True"));
  const auto a = p.allocate(600 * KiB);
  EXPECT_EQ(p.stats().reserved_bytes.current, 2 * MiB);
  const auto b = p.allocate(600 * KiB);
  EXPECT_EQ(*b, *a + 600 * KiB);
  // 600 KiB more does not fit the 848 KiB left? It does: 2048 - 1200 = 848 KiB. A fourth does not:
  // the segment grows by one 2 MiB page, contiguous with the first.
  p.allocate(600 * KiB);
  const auto d = p.allocate(600 * KiB);
  EXPECT_EQ(p.stats().reserved_bytes.current, 4 * MiB);
  EXPECT_EQ(*d, *a + 1800 * KiB);
  EXPECT_EQ(p.segments().size(), 1u);
}

TEST(CachingPolicy, EveryEventIsObserved) {
  CachingPolicy p;
  std::vector<TraceEvent> events;
  p.set_observer([&](const TraceEvent& e) { events.push_back(e); });
  const auto a = p.allocate(100);
  p.free(*a);
  p.empty_cache();
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].action, TraceAction::segment_alloc);
  EXPECT_EQ(events[0].size, 2 * MiB);
  EXPECT_EQ(events[1].action, TraceAction::alloc);
  EXPECT_EQ(events[1].size, 100);
  EXPECT_EQ(events[2].action, TraceAction::free_requested);
  EXPECT_EQ(events[3].action, TraceAction::free_completed);
  EXPECT_EQ(events[4].action, TraceAction::segment_free);
  EXPECT_EQ(events[4].address, events[0].address);
}

TEST(AllocatorConfig, ParsesPyTorchsSyntaxAndRefusesWhatItDoesNot) {
  const AllocatorConfig c = conf("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.8");
  EXPECT_TRUE(c.expandable_segments);
  EXPECT_EQ(c.max_split_size, 128 * MiB);
  EXPECT_DOUBLE_EQ(c.garbage_collection_threshold, 0.8);
  EXPECT_EQ(conf("").max_split_size, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(conf("backend:native,release_lock_on_cudamalloc:True").ignored.size(), 1u);
  EXPECT_EQ(parse_allocator_config(c.text(), "text").text(), c.text());
  // Divisions survive the round trip: the same rounding after it.
  for (const char* text : {"roundup_power2_divisions:4", "roundup_power2_divisions:[256:1,512:2,>:8]",
                           "roundup_power2_divisions:[256:1,512:2,1024:8]"}) {
    const AllocatorConfig d = conf(text);
    const AllocatorConfig back = parse_allocator_config(d.text(), "text");
    EXPECT_EQ(back.roundup_power2_divisions, d.roundup_power2_divisions) << text << " -> " << d.text();
  }
  // A leading ">" fills from the second interval, as PyTorch's parser does: below 2 MiB, none.
  EXPECT_EQ(conf("roundup_power2_divisions:[>:4]").roundup_power2_divisions[0], 0);
  EXPECT_EQ(conf("roundup_power2_divisions:[>:4]").roundup_power2_divisions[1], 4);
  for (const char* bad : {"max_split_size_mb:19", "garbage_collection_threshold:1.5", "expandable_segments:yes",
                          "roundup_power2_divisions:3", "roundup_power2_divisions:[256:1", "colour:blue",
                          "expandable_segments:true",
                          "backend:cudaMallocAsync", "max_split_size_mb", "roundup_power2_divisions:[300:2]"}) {
    EXPECT_THROW(conf(bad), Error) << bad;
  }
}

// Every key the linked torch's own parser knows (its registry of keys, CUDA's among them) is accepted
// by the environment's check, with a value that parser accepts; a key it does not know is refused. A
// torch release that adds a key fails here until headroom knows it.
TEST(AllocatorConfig, AcceptsEveryKeyOfTheLinkedTorch) {
  const std::map<std::string, std::string> value{
      {"max_split_size_mb", "64"}, {"max_non_split_rounding_mb", "64"}, {"roundup_power2_divisions", "4"},
      {"garbage_collection_threshold", "0.5"}, {"expandable_segments", "True"}, {"large_segment_size_mb", "20"},
      {"backend", "native"}, {"release_lock_on_cudamalloc", "True"}, {"pinned_use_cuda_host_register", "True"},
      {"release_lock_on_hipmalloc", "True"}, {"pinned_use_hip_host_register", "True"},
      {"pinned_num_register_threads", "4"}, {"pinned_use_background_threads", "True"},
      {"pinned_reserve_segment_size_mb", "64"}, {"pinned_max_round_threshold_mb", "64"},
      {"pinned_max_cached_size_mb", "256"}, {"pinned_free_catch_all", "True"},
      {"graph_capture_record_stream_reuse", "True"}, {"per_process_memory_fraction", "0.5"},
      {"throw_on_cudamalloc_oom", "True"}, {"expandable_segments_reserve", "40G"},
      {"expandable_segments_reserve_by_class", "[decode:0.25,prefill:8G]"}};
  const auto& keys = c10::CachingAllocator::AcceleratorAllocatorConfig::getKeys();
  ASSERT_TRUE(keys.count("max_split_size_mb")) << "the linked torch's registry of allocator keys";
  for (const std::string& key : keys) {
    const auto v = value.find(key);
    if (v == value.end()) {
      ADD_FAILURE() << "the linked torch accepts '" << key << "', which headroom does not know";
      continue;
    }
    EXPECT_NO_THROW(check_allocator_config(key + ":" + v->second, "test")) << key;
  }
  for (const auto& [key, v] : value) {
    if (!keys.count(key)) {
      EXPECT_THROW(check_allocator_config(key + ":" + v, "test"), Error) << key;
    }
  }
}

}  // namespace
}  // namespace headroom
