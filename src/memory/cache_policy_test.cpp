#include "memory/cache_policy.h"

#include <gtest/gtest.h>

#include "memory/oom_report.h"

namespace headroom {
namespace {

constexpr int64_t MiB = 1 << 20;

TEST(CachePolicy, ExpandableSegmentsOnlyWhenFragmentationCouldHoldTheRequest) {
  // 300 MiB free in split segments, a 200 MiB request failed: fragmentation is the cause.
  const CacheDecision frag = after_oom({900 * MiB, 1200 * MiB, 300 * MiB, 200 * MiB, false});
  EXPECT_EQ(frag.action, CacheAction::expandable_segments);
  EXPECT_NE(frag.reason.find("could have held"), std::string::npos) << frag.reason;
  // Only 50 MiB free inside segments: the memory is really used; halving is the lever.
  EXPECT_EQ(after_oom({1150 * MiB, 1200 * MiB, 50 * MiB, 200 * MiB, false}).action, CacheAction::none);
  // 40 MiB free in segments is less than the 200 MiB request, but 900 + 200 fits a 1200 MiB cap:
  // only the segments stand in the way.
  const CacheDecision capped = after_oom({900 * MiB, 1180 * MiB, 40 * MiB, 200 * MiB, false, 1200 * MiB});
  EXPECT_EQ(capped.action, CacheAction::expandable_segments);
  EXPECT_EQ(after_oom({1100 * MiB, 1180 * MiB, 40 * MiB, 200 * MiB, false, 1200 * MiB}).action, CacheAction::none);
  // Already on, or the request unknown: nothing to switch.
  EXPECT_EQ(after_oom({900 * MiB, 1200 * MiB, 300 * MiB, 200 * MiB, true}).action, CacheAction::none);
  EXPECT_EQ(after_oom({900 * MiB, 1200 * MiB, 300 * MiB, 0, false}).action, CacheAction::none);
}

TEST(CachePolicy, EmptyCacheAfterAReshapeOnlyWhenTheGapIsLarge) {
  EXPECT_TRUE(empty_cache_after_reshape(500 * MiB, 1000 * MiB));   // half the reservation is idle
  EXPECT_FALSE(empty_cache_after_reshape(950 * MiB, 1000 * MiB));  // 5%: not worth the cudaFree calls
  EXPECT_FALSE(empty_cache_after_reshape(0, 0));
}

TEST(CachePolicy, TheRequestIsReadFromCudasMessage) {
  EXPECT_EQ(requested_bytes_of("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
                               "79.19 GiB of which 3.06 MiB is free."),
            20 * MiB);
  EXPECT_EQ(requested_bytes_of("CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; ...)"), 3 * 512 * MiB);
  EXPECT_EQ(requested_bytes_of("some other failure"), 0);
}

}  // namespace
}  // namespace headroom
