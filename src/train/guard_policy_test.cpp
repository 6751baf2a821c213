#include "train/guard_policy.h"

#include <gtest/gtest.h>

namespace headroom {
namespace {

TEST(GuardPolicy, HalvesBeforeTheUpdateAndGivesUpOtherwise) {
  EXPECT_EQ(after_step_oom(8, false, true, std::nullopt).action, GuardAction::halve);
  EXPECT_EQ(after_step_oom(8, false, true, std::nullopt).micro, 4);
  EXPECT_EQ(after_step_oom(5, false, true, std::nullopt).micro, 3);  // rounded up: 3 + 2 rows
  EXPECT_EQ(accumulation_for(5, 3), 2);
  EXPECT_EQ(after_step_oom(1, false, true, std::nullopt).action, GuardAction::give_up);
  EXPECT_EQ(after_step_oom(8, true, true, std::nullopt).action, GuardAction::give_up);    // in the update
  EXPECT_EQ(after_step_oom(8, false, false, std::nullopt).action, GuardAction::give_up);  // --no-guard
}

TEST(GuardPolicy, FragmentationRetriesTheSameMicroBatchInExpandableSegments) {
  // 30 MiB free inside split segments could have held the 20 MiB request: the same micro-batch again.
  const CacheState fragmented{100 << 20, 160 << 20, 30 << 20, 20 << 20, false, 160 << 20};
  const GuardDecision d = after_step_oom(1, false, true, fragmented);
  EXPECT_EQ(d.action, GuardAction::again);
  EXPECT_EQ(d.micro, 1);
  EXPECT_FALSE(d.reason.empty());
  CacheState full = fragmented;
  full.expandable_segments = true;  // already on: nothing more the cache can do
  EXPECT_EQ(after_step_oom(4, false, true, full).action, GuardAction::halve);
  EXPECT_EQ(after_step_oom(1, false, true, full).action, GuardAction::give_up);
}

}  // namespace
}  // namespace headroom
