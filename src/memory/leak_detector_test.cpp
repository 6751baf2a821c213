#include "memory/leak_detector.h"

#include <gtest/gtest.h>

#include "device/cuda_adapter.h"
#include "testing/test_models.h"
#include "train/trainer.h"
#include "util/error.h"

namespace headroom {
namespace {

std::vector<StepLive> series(int64_t base, double per_step, int64_t transient, int64_t steps, int64_t noise = 0) {
  std::vector<StepLive> out;
  for (int64_t s = 1; s <= steps; ++s) {
    const int64_t wobble = noise * ((s * 7919) % 5 - 2);  // deterministic, zero-mean
    out.push_back({s, base + static_cast<int64_t>(per_step * static_cast<double>(s)) + wobble, transient});
  }
  return out;
}

TEST(LeakDetector, SteadyGrowthIsALeakAndNoiseIsNot) {
  // Against a 10 MiB transient the threshold is 1% of it, 102.4 KiB a step: 64 KiB is below it.
  EXPECT_FALSE(judge_growth(series(1'000'000, 64 * 1024, 10 << 20, 12)).detected);
  EXPECT_TRUE(judge_growth(series(1'000'000, 256 * 1024, 10 << 20, 12)).detected);
  // Flat with noise well above the threshold: the robust slope stays at zero.
  EXPECT_FALSE(judge_growth(series(1'000'000, 0, 10 << 20, 12, 500'000)).detected);
  // Warm-up growth (steps 1-2) is not counted.
  auto warm = series(1'000'000, 0, 10 << 20, 12);
  warm[0].live_after = 0;
  warm[1].live_after = 500'000;
  EXPECT_FALSE(judge_growth(warm).detected);
  // Too few steps: no verdict.
  const LeakVerdict few = judge_growth(series(0, 1 << 20, 10 << 20, 4));
  EXPECT_FALSE(few.detected);
  EXPECT_NE(few.reason.find("needed for a verdict"), std::string::npos);
}

RunConfig leak_run(LeakInjection leak) {
  const auto models = testing::shrunk_models();
  RunConfig c;
  c.model = models[1].preset;  // llama, shrunk
  c.overrides = models[1].overrides;
  c.batch = 2;
  c.seq = 32;
  c.steps = 12;
  c.eval_rows = 0;
  c.quiet = true;
  c.device = "cpu";
  c.inject_leak = leak;
  return c;
}

TEST(LeakDetector, FindsThePlantedLeaksWithTheirSites) {
  const int64_t tokens = 2 * 32, vocab = 256;
  {
    const TrainResult run = train(leak_run(LeakInjection::keep_outputs));
    const TrainSummary& s = run.summary;
    const LeakVerdict v = judge_growth(run.live_series());
    EXPECT_TRUE(v.detected) << v.reason;
    // One float32 logits tensor a step: B·T·vocab·4 bytes.
    EXPECT_NEAR(v.bytes_per_step, static_cast<double>(tokens * vocab * 4), 1.0) << v.reason;
    ASSERT_FALSE(s.surviving.empty());
    EXPECT_EQ(s.surviving[0].bytes, tokens * vocab * 4);
    EXPECT_EQ(s.surviving[0].phase, "forward");
    EXPECT_EQ(s.surviving[0].count, 10);  // steps 3..12
    EXPECT_NE(s.surviving[0].description.find("created during forward of every step and never freed"),
              std::string::npos)
        << s.surviving[0].description;
  }
  {
    const TrainResult run = train(leak_run(LeakInjection::keep_graph));
    const TrainSummary& s = run.summary;
    const LeakVerdict v = judge_growth(run.live_series());
    EXPECT_TRUE(v.detected) << v.reason;
    // The whole graph's saved activations, more than the logits alone.
    EXPECT_GT(v.bytes_per_step, static_cast<double>(tokens * vocab * 4)) << v.reason;
    ASSERT_FALSE(s.surviving.empty());
    EXPECT_EQ(s.surviving[0].phase, "forward");
  }
}

// On cuda the sites come from the caching allocator's records, tagged with step and phase. Without a
// GPU, what can be checked is that a cuda run is refused with the reason.
TEST(LeakDetector, FindsThePlantedLeakOnCudaFromTheCachingAllocatorsRecords) {
  RunConfig c = leak_run(LeakInjection::keep_outputs);
  c.device = "cuda";
  c.leak_origins = true;
  if (!cuda_available()) {
    EXPECT_THROW(train(c), Error);
    return;
  }
  const int64_t tokens = 2 * 32, vocab = 256;
  const TrainResult run = train(c);
  const TrainSummary& s = run.summary;
  EXPECT_TRUE(judge_growth(run.live_series()).detected);
  ASSERT_FALSE(s.surviving.empty());
  EXPECT_EQ(s.surviving[0].bytes, tokens * vocab * 4);  // as requested, before the allocator rounds
  EXPECT_EQ(s.surviving[0].phase, "forward");
  EXPECT_EQ(s.surviving[0].count, 10);  // steps 3..12
  c.inject_leak = LeakInjection::none;
  const TrainSummary clean = train(c).summary;
  EXPECT_TRUE(clean.surviving.empty()) << clean.surviving[0].description;
}

TEST(LeakDetector, NoFalseAlarmOnCleanRunsOfEveryFamilyAndPrecision) {
  for (const auto& m : testing::shrunk_models()) {
    for (Precision precision : {Precision::fp32, Precision::bf16_mixed, Precision::fp16_mixed, Precision::bf16}) {
      RunConfig c = leak_run(LeakInjection::none);
      c.model = m.preset;
      c.overrides = m.overrides;
      c.precision = precision;
      c.seq = 16;
      c.steps = 8;
      const TrainResult run = train(c);
      const LeakVerdict v = judge_growth(run.live_series());
      const char* name = precision_name(precision);
      EXPECT_FALSE(v.detected) << m.label << " " << name << ": " << v.reason;
      EXPECT_TRUE(run.summary.surviving.empty())
          << m.label << " " << name << ": " << run.summary.surviving[0].description;
    }
  }
}

}  // namespace
}  // namespace headroom
