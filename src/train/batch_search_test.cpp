#include "train/batch_search.h"

#include <gtest/gtest.h>

#include <cmath>

namespace headroom {
namespace {

// A synthetic device: peak(b) = fixed + per_row * b, optionally rounded up to `granule` (as CUDA's
// caching allocator rounds segments) — independent of the code under test.
TrialFunction device(int64_t fixed, int64_t per_row, int64_t budget, int64_t granule = 1) {
  return [=](int64_t b) {
    int64_t peak = fixed + per_row * b;
    peak = (peak + granule - 1) / granule * granule;
    return Trial{b, peak <= budget, peak};
  };
}

int64_t true_max(const TrialFunction& t, int64_t limit) {
  int64_t b = 0;
  while (b < limit && t(b + 1).fits) ++b;
  return b;
}

TEST(BatchSearch, AffineMemoryIsSolvedInThreeTrials) {
  for (int64_t budget : {1'000'000, 3'333'333, 77'777'777, 500'000'000}) {
    const auto t = device(400'000, 12'345, budget);
    const FitResult r = search_max_batch(t, budget, 1 << 16);
    EXPECT_EQ(r.max_batch, true_max(t, 1 << 16)) << budget;
    EXPECT_LE(r.log.size(), 3u) << budget;
  }
}

TEST(BatchSearch, RoundedMemoryStillFindsTheTrueMaximum) {
  for (int64_t budget : {5'000'000, 20'000'000, 64'000'000}) {
    const auto t = device(1'000'000, 150'000, budget, 2 << 20);  // 2 MiB granules
    const FitResult r = search_max_batch(t, budget, 4096);
    EXPECT_EQ(r.max_batch, true_max(t, 4096)) << budget;
    std::string tried;
    for (const Trial& x : r.log) tried += std::to_string(x.batch) + (x.fits ? "+ " : "- ");
    EXPECT_LE(r.log.size(), 12u) << tried;
  }
}

TEST(BatchSearch, AnExactPredictorNeedsTwoTrialsAndAWrongOneIsCorrected) {
  const int64_t fixed = 400'000, per_row = 12'345, limit = 1 << 16;
  for (int64_t budget : {1'000'000, 3'333'333, 77'777'777}) {
    const auto t = device(fixed, per_row, budget);
    const int64_t truth = true_max(t, limit);
    // Exact: the predicted maximum fits and the next batch does not.
    const FitResult exact = search_max_batch(t, budget, limit, [&](int64_t b) { return fixed + per_row * b; });
    EXPECT_EQ(exact.max_batch, truth) << budget;
    EXPECT_EQ(exact.log.size(), 2u) << budget;
    // 10% low and 10% high: the first trial's measurement corrects the prediction.
    for (double bias : {0.9, 1.1}) {
      const FitResult r = search_max_batch(t, budget, limit, [&](int64_t b) {
        return static_cast<int64_t>(bias * static_cast<double>(fixed + per_row * b));
      });
      EXPECT_EQ(r.max_batch, truth) << budget << " bias " << bias;
      std::string tried;
      for (const Trial& x : r.log) tried += std::to_string(x.batch) + (x.fits ? "+ " : "- ");
      EXPECT_LE(r.log.size(), 4u) << budget << " bias " << bias << ": " << tried;
    }
  }
  // Rounded memory and a predictor that ignores the rounding.
  const auto rounded = device(1'000'000, 150'000, 20'000'000, 2 << 20);
  const FitResult r = search_max_batch(rounded, 20'000'000, 4096, [](int64_t b) { return 1'000'000 + 150'000 * b; });
  EXPECT_EQ(r.max_batch, true_max(rounded, 4096));
}

TEST(BatchSearch, EdgesNothingFitsOnlyOneFitsAndTheLimit) {
  EXPECT_EQ(search_max_batch(device(2000, 10, 1000), 1000, 64).max_batch, 0);
  EXPECT_EQ(search_max_batch(device(900, 60, 1000), 1000, 64).max_batch, 1);
  EXPECT_EQ(search_max_batch(device(900, 30, 1000), 1000, 64).max_batch, 3);
  const FitResult capped = search_max_batch(device(0, 1, 1'000'000), 1'000'000, 50);
  EXPECT_EQ(capped.max_batch, 50);
  for (const Trial& trial : capped.log) EXPECT_LE(trial.batch, 50);
}

TEST(BatchSearch, RealTrialsOnTinyFindTheTrueMaximum) {
  RunConfig cfg;
  cfg.model = "tiny";
  cfg.overrides = {"num_hidden_layers=2"};
  cfg.seq = 64;
  cfg.device = "cpu";
  cfg.memory_budget = int64_t{60} << 20;
  const FitResult r = search_max_batch([&](int64_t b) { return trial_step(cfg, b); }, 60 << 20, 256);
  ASSERT_GT(r.max_batch, 1);
  // Independently: the maximum fits and one more does not.
  EXPECT_TRUE(trial_step(cfg, r.max_batch).fits);
  EXPECT_FALSE(trial_step(cfg, r.max_batch + 1).fits);
  EXPECT_LE(r.log.size(), 4u);
}

}  // namespace
}  // namespace headroom
