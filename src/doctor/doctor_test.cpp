// The default doctor run end to end: it finds the OOM, measures what the estimator predicted, tries
// the levers, and its recommended plan trains under the budget; its report renders in Chromium.
#include "doctor/doctor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "doctor/report_html.h"
#include "testing/command.h"
#include "testing/temp_dir.h"

namespace headroom {
namespace {

std::string run_command(const std::string& command) { return testing::run_command(command).out; }

// The default's naive setting: the OOM found, the whole step measured against the estimate, no leak.
void expect_the_oom_found_and_measured(const DoctorReport& r, int64_t budget) {
  EXPECT_TRUE(r.oom) << "the default's naive setting must not fit";
  // "What happened" shows every category of what was in use, the largest (activations) included.
  EXPECT_THAT(r.to_text(), ::testing::ContainsRegex("in use by category:\n +weights .*\n +gradients .*\n +optimizer "
                                                    ".*\n +activations +[0-9.]+ [KMG]iB +[0-9.]+%"));
  EXPECT_FALSE(r.oom_phase.empty());
  EXPECT_EQ(r.oom_step, 1);
  // The whole step, measured without the budget, against the estimate.
  ASSERT_TRUE(r.measured_whole_step);
  EXPECT_GT(r.measured_peak, budget);
  EXPECT_NEAR(static_cast<double>(r.estimate.peak_bytes), static_cast<double>(r.measured_peak),
              0.03 * static_cast<double>(r.measured_peak));
  EXPECT_FALSE(r.leak.detected) << r.leak.reason;
}

// How many of the levers that apply were measured in a real step, and how many predicted.
struct LeverCounts {
  int measured = 0, predicted = 0;
};

// Every lever tried, each one's figures consistent with the budget.
LeverCounts expect_each_lever_tried(const DoctorReport& r, int64_t budget) {
  bool saw[5] = {};
  int measured = 0, predicted = 0;
  for (const LeverTrial& l : r.levers) {
    if (l.lever == "accumulation") saw[0] = true;
    if (l.lever == "precision") saw[1] = true;
    if (l.lever == "checkpointing") saw[2] = true;
    if (l.lever == "attention") saw[3] = true;
    if (l.lever == "optimizer") saw[4] = true;
    if (l.lever == "optimizer" && l.setting == "adam") {
      // Adam and AdamW hold the same state: the same peak, measured or predicted.
      EXPECT_EQ(l.peak_bytes, l.measured ? r.measured_peak : r.estimate.peak_bytes);
    }
    if (l.applies) (l.measured ? measured : predicted) += 1;
    if (l.lever == "checkpointing" && l.setting == "full") {
      EXPECT_TRUE(l.fits);
      EXPECT_GT(l.saving_bytes, 0);
    }
    if (l.lever == "empty-cache" || l.lever == "static graph") {
      EXPECT_FALSE(l.applies) << l.lever;
    }
    if (l.applies) {
      EXPECT_EQ(l.fits, l.peak_bytes <= budget) << l.lever << " " << l.setting;
    }
  }
  for (bool s : saw) EXPECT_TRUE(s);
  return {measured, predicted};
}

// Lever 6: the configuration on 2 local ranks, half the rows each, for each shard level, run for
// real: each rank's peak below the one process's, and lower the more is sharded.
void expect_data_parallel_measured_at_each_shard_level(const DoctorReport& r) {
  std::vector<int64_t> rank_peaks;
  for (const LeverTrial& l : r.levers) {
    if (l.lever != "data parallel") continue;
    EXPECT_TRUE(l.applies && l.measured) << l.setting << ": " << l.note;
    EXPECT_LT(l.peak_bytes, r.measured_peak) << l.setting;
    EXPECT_GT(l.step_time_ratio, 0) << l.setting;
    rank_peaks.push_back(l.peak_bytes);
  }
  ASSERT_EQ(rank_peaks.size(), 4u) << "none, optimizer, gradients, full";
  EXPECT_GT(rank_peaks[0], rank_peaks[1]);
  EXPECT_GE(rank_peaks[1], rank_peaks[2]);
  EXPECT_GE(rank_peaks[2], rank_peaks[3]);  // the default's embeddings are small: slicing the layers pays
}

// The recommended plan trained under the budget, on the same global batch.
void expect_the_plan_fits(const DoctorReport& r, const RunConfig& cfg, int64_t budget) {
  ASSERT_TRUE(r.plan_found) << r.plan_note;
  EXPECT_TRUE(r.plan_verified);
  EXPECT_LE(r.verified_peak_bytes, budget);
  EXPECT_EQ(r.plan.batch * r.plan.accum, cfg.batch * cfg.accum);
}

void expect_the_json_complete(const DoctorReport& r) {
  const nlohmann::json j = r.to_json();
  EXPECT_TRUE(j["oom"]["happened"].get<bool>());
  for (const char* key : {"measured", "estimate", "leak", "levers", "plan"}) EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_TRUE(j["plan"].contains("verified_peak_bytes"));
  for (const auto& l : j["levers"]) {
    for (const char* key : {"lever", "setting", "peak_bytes", "saving_bytes", "step_time_ratio", "fits"}) {
      EXPECT_TRUE(l.contains(key)) << key;
    }
  }
}

// The report renders in a real browser, with its charts.
void expect_the_report_renders_in_chromium(const DoctorReport& r) {
  testing::TempDir dir;
  const std::string page = dir.file("report.html"), png = dir.file("report.png");
  {
    std::ofstream f(page);
    f << report_html(r);
  }
  const std::string chromium = "chromium --headless --no-sandbox --disable-gpu --window-size=1000,2400 ";
  ASSERT_EQ(std::system(("command -v chromium > /dev/null")), 0) << "Chromium is needed (scripts/setup installs it)";
  const std::string dom = run_command(chromium + "--dump-dom file://" + page + " 2>/dev/null");
  for (const char* id :
       {"id=\"timeline\"", "id=\"breakdown\"", "id=\"levers\"", "id=\"lever-table\"", "Out of memory"}) {
    EXPECT_NE(dom.find(id), std::string::npos) << id;
  }
  run_command(chromium + "--screenshot=" + png + " file://" + page + " 2>/dev/null");
  std::ifstream shot(png, std::ios::binary);
  std::stringstream bytes;
  bytes << shot.rdbuf();
  const std::string data = bytes.str();
  ASSERT_GT(data.size(), 20'000u) << "a screenshot of the rendered page";
  EXPECT_EQ(data.substr(1, 3), "PNG");
}

// One doctor run (minutes), every check of it in turn; a fatal failure in one ends the test.
TEST(Doctor, TheDefaultFindsTheOomTriesTheLeversAndItsPlanFits) {
  const RunConfig cfg = doctor_default();
  const int64_t budget = *cfg.memory_budget;
  ::setenv("HEADROOM_EXECUTABLE", HEADROOM_BINARY, 1);  // the ranks of lever 6 are the CLI, not this test binary
  const DoctorReport r = run_doctor(cfg, budget, nullptr);

  ASSERT_NO_FATAL_FAILURE(expect_the_oom_found_and_measured(r, budget));
  const LeverCounts counts = expect_each_lever_tried(r, budget);
  ASSERT_NO_FATAL_FAILURE(expect_data_parallel_measured_at_each_shard_level(r));
  // On cpu the estimator predicts the levers and only those near the budget run for real.
  EXPECT_GT(counts.measured, 0);
  EXPECT_GT(counts.predicted, 0);
  ASSERT_NO_FATAL_FAILURE(expect_the_plan_fits(r, cfg, budget));
  expect_the_json_complete(r);
  expect_the_report_renders_in_chromium(r);
}

// A budget nothing can fit is said so at once: no lever trial, no plan, the smallest peak named.
TEST(Doctor, ABudgetNothingCanFitStopsEarlyAndSaysWhy) {
  RunConfig cfg = doctor_default();
  const auto started = std::chrono::steady_clock::now();
  const DoctorReport r = run_doctor(cfg, 1024, nullptr);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_TRUE(r.oom);
  EXPECT_FALSE(r.plan_found);
  EXPECT_TRUE(r.levers.empty());
  EXPECT_THAT(r.plan_note, ::testing::HasSubstr("nothing can fit 1.00 KiB: the smallest peak any combination of "
                                                "levers reaches (other optimizers and pure bf16 included) is"));
  EXPECT_LT(seconds, 30) << "no trial beyond the configuration as given";
}

// When the configuration as given fits, the plan keeps its numerics (precision, optimizer); faster
// plans that change them are listed as options.
TEST(Doctor, AConfigurationThatFitsKeepsItsNumericsAndListsOptions) {
  RunConfig cfg = doctor_default();
  cfg.batch = 4;
  cfg.seq = 64;
  const DoctorReport r = run_doctor(cfg, int64_t{4} << 30, nullptr);
  EXPECT_FALSE(r.oom);
  ASSERT_TRUE(r.plan_found) << r.plan_note;
  EXPECT_EQ(r.plan.precision, cfg.precision);
  EXPECT_EQ(r.plan.optimizer, cfg.optimizer);
  for (const Plan& p : r.options) EXPECT_TRUE(p.precision != cfg.precision || p.optimizer != cfg.optimizer);
  EXPECT_THAT(r.to_text(), ::testing::HasSubstr("4. Plan: the configuration as given fits"));
}

}  // namespace
}  // namespace headroom
