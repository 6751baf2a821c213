// RunConfig: typed settings parsed once from flags and TOML, and the trial form other commands use.
#include "config/run_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "util/error.h"

namespace headroom {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

RunConfig from_flags(const std::vector<std::pair<std::string, std::string>>& flags) {
  RunConfig c;
  for (const auto& [key, value] : flags) {
    for (const RunField& f : run_fields()) {
      if (f.key == key) f.set(c, value);
    }
  }
  return c;
}

TEST(RunConfig, LeverSettingsAreParsedOnceIntoTheirTypes) {
  const RunConfig c = from_flags({{"precision", "bf16-mixed"},
                                  {"optimizer", "adafactor"},
                                  {"checkpointing", "every:3"},
                                  {"attention", "math"},
                                  {"memory-budget", "512MiB"},
                                  {"inject-leak", "keep-outputs"},
                                  {"plan", "auto"}});
  EXPECT_EQ(c.precision, Precision::bf16_mixed);
  EXPECT_EQ(c.optimizer, OptimizerKind::adafactor);
  EXPECT_EQ(c.checkpointing, CheckpointPolicy::every_kth(3));
  EXPECT_EQ(c.attention, AttentionPath::math);
  EXPECT_EQ(c.memory_budget, int64_t{512} << 20);
  EXPECT_EQ(c.inject_leak, LeakInjection::keep_outputs);
  EXPECT_TRUE(c.plan_auto);
  // every:1 recomputes every layer: it is full, so no lever can offer full to it again.
  EXPECT_EQ(from_flags({{"checkpointing", "every:1"}}).checkpointing, CheckpointPolicy::full());
  EXPECT_THAT([] { from_flags({{"attention", "fast"}}); }, ThrowsMessage<Error>(HasSubstr("accepted: flash")));
  EXPECT_THAT([] { from_flags({{"memory-budget", "0"}}); }, ThrowsMessage<Error>(HasSubstr("must be positive")));
  EXPECT_THAT([] { from_flags({{"plan", "fastest"}}); }, ThrowsMessage<Error>(HasSubstr("accepted: auto")));
}

// A trial (a planner's timed step, a fit trial, a doctor's lever) runs a few steps of the
// configuration: a warm-up longer than the trial must not make it invalid.
TEST(RunConfig, ATrialKeepsWhatItTrainsAndDropsTheSchedule) {
  RunConfig c;
  c.steps = 200;
  c.warmup = 50;
  c.metrics = "m.jsonl";
  c.checkpoint = "ckpt";
  c.inject_oom = parse_oom_injection("3:10");
  c.precision = Precision::bf16;
  EXPECT_THAT(
      [&] {
        RunConfig short_run = c;
        short_run.steps = 4;
        validate(short_run);
      },
      ThrowsMessage<Error>(HasSubstr("--warmup 50 is longer than --steps 4")));
  const RunConfig t = as_trial(c, 2);
  validate(t);
  EXPECT_EQ(t.steps, 2);
  EXPECT_TRUE(t.no_guard);
  EXPECT_TRUE(t.metrics.empty() && t.checkpoint.empty() && !t.inject_oom);
  EXPECT_EQ(t.precision, Precision::bf16);
}

}  // namespace
}  // namespace headroom
