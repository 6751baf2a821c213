// Sharded checkpoints on 2 cpu ranks under torchrun: each rank's file holds its slices; the same
// layout resumes to the identical loss sequence, and one process or another shard level resumes it
// to the same losses within rounding.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dist/data_parallel_testing.h"
#include "testing/command.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"

namespace headroom {
namespace {

using data_parallel_testing::launch;
using data_parallel_testing::torchrun;
using testing::read_jsonl;
using testing::run_command;
using testing::TempDir;

// The start of a command line running the CLI on 2 local ranks.
std::string torchrun_prefix() {
  return fmt::format("env OMP_NUM_THREADS=1 {} --standalone --no-python --nproc-per-node 2 {}", torchrun(),
                     HEADROOM_BINARY);
}

// Resumes of a 4-step run's checkpoint at step 2, each by its command line, whose last 2 losses must
// be those of the uninterrupted run `a` within its tolerance (0: identical).
struct Resume {
  std::string name, command;
  double tolerance;
};
void expect_resumes(const std::vector<Resume>& resumes, const std::vector<nlohmann::json>& a, const TempDir& dir) {
  for (const Resume& r : resumes) {
    SCOPED_TRACE(r.name);
    const std::string metrics = dir.file(r.name + ".jsonl");
    const auto out = run_command(r.command + " --metrics '" + metrics + "' 2>&1");
    ASSERT_EQ(out.code, 0) << out.out;
    const auto c = read_jsonl(metrics);
    ASSERT_EQ(c.size(), 2u);
    for (size_t i = 0; i < c.size(); ++i) {
      EXPECT_NEAR(c[i].at("loss").get<double>(), a[i + 2].at("loss").get<double>(), r.tolerance) << "step " << i + 3;
    }
  }
}

// A sharded adafactor checkpoint holds the whole factored moments in every rank's file and the
// vectors' moments sliced: it resumes in the same layout to the identical losses, and alone or at
// another shard level to the same losses within rounding.
TEST(DataParallel, AdafactorCheckpointResumesInOtherLayouts) {
  TempDir dir;
  const std::string common =
      "train --device cpu --model tiny --steps 4 --seq 32 --eval-rows 0 --quiet --optimizer adafactor --lr 0.01";
  const std::string full = common + " --batch 2 --shard full";
  const auto whole = launch(2, HEADROOM_BINARY, full + " --metrics " + dir.file("whole.jsonl"));
  ASSERT_EQ(whole.code, 0) << whole.out;
  const std::string ck = dir.file("ck");
  const auto first = launch(2, HEADROOM_BINARY, full + " --stop-at 2 --checkpoint " + ck);
  ASSERT_EQ(first.code, 0) << first.out;
  for (const char* copy : {"ck-alone", "ck-gradients"}) {
    std::filesystem::create_directories(dir.file(copy));
    for (const char* f : {"manifest.json", "rank-0-of-2.hrc", "rank-1-of-2.hrc"}) {
      std::filesystem::copy_file(ck + "/" + f, dir.file(copy) + "/" + f);
    }
  }
  const auto a = read_jsonl(dir.file("whole.jsonl"));
  ASSERT_EQ(a.size(), 4u);
  const std::vector<Resume> resumes = {
      {"full", fmt::format("{} {} --resume {}", torchrun_prefix(), full, ck), 0.0},
      {"alone",
       fmt::format("env OMP_NUM_THREADS=1 {} {} --batch 4 --resume {}", HEADROOM_BINARY, common, dir.file("ck-alone")),
       1e-5},
      {"gradients",
       fmt::format("{} {} --batch 2 --shard gradients --resume {}", torchrun_prefix(), common,
                   dir.file("ck-gradients")),
       1e-5},
  };
  expect_resumes(resumes, a, dir);
}

TEST(DataParallel, ShardedCheckpointResumesToTheSameLossSequence) {
  TempDir dir;
  const std::string common = fmt::format(
      "train --device cpu --model tiny --steps 4 --seq 32 --batch 2 --eval-rows 0 --quiet --shard gradients");
  const auto whole = launch(2, HEADROOM_BINARY, common + " --metrics " + dir.file("whole.jsonl"));
  ASSERT_EQ(whole.code, 0) << whole.out;
  const std::string ck = dir.file("ck");
  const auto first =
      launch(2, HEADROOM_BINARY, common + " --stop-at 2 --checkpoint " + ck + " --metrics " + dir.file("parts.jsonl"));
  ASSERT_EQ(first.code, 0) << first.out;
  EXPECT_TRUE(std::filesystem::exists(ck + "/manifest.json"));
  EXPECT_TRUE(std::filesystem::exists(ck + "/rank-1-of-2.hrc"));
  // Copies at step 2, for resuming in other layouts below.
  for (const std::string& how : {std::string("alone"), std::string("optimizer")}) {
    const std::string copy = dir.file("ck-" + how);
    std::filesystem::create_directories(copy);
    for (const char* f : {"manifest.json", "rank-0-of-2.hrc", "rank-1-of-2.hrc"}) {
      std::filesystem::copy_file(ck + "/" + f, copy + "/" + f);
    }
  }
  const auto second = launch(2, HEADROOM_BINARY, common + " --resume " + ck + " --metrics " + dir.file("parts.jsonl"));
  ASSERT_EQ(second.code, 0) << second.out;
  const auto a = read_jsonl(dir.file("whole.jsonl")), b = read_jsonl(dir.file("parts.jsonl"));
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].at("loss"), b[i].at("loss")) << "step " << i + 1;

  // A lone process (the same global batch: 4 rows) resumes it too, the optimizer state put together
  // from the ranks' slices; and so do 2 ranks at another shard level. The same losses, to rounding.
  for (const std::string& how : {std::string("alone"), std::string("optimizer")}) {
    SCOPED_TRACE(how);
    const std::string copy = dir.file("ck-" + how);
    const std::string metrics = dir.file(how + ".jsonl");
    const std::string args = "train --device cpu --model tiny --steps 4 --seq 32 --eval-rows 0 --quiet --resume " +
                             copy + " --metrics " + metrics;
    const auto r = how == "alone"
                       ? run_command(fmt::format("env OMP_NUM_THREADS=1 {} {} --batch 4 2>&1", HEADROOM_BINARY, args))
                       : launch(2, HEADROOM_BINARY, args + " --batch 2 --shard optimizer");
    ASSERT_EQ(r.code, 0) << r.out;
    const auto c = read_jsonl(metrics);
    ASSERT_EQ(c.size(), 2u);
    for (size_t i = 0; i < c.size(); ++i) {
      EXPECT_NEAR(c[i].at("loss").get<double>(), a[i + 2].at("loss").get<double>(), 1e-5) << "step " << i + 3;
    }
  }
}

// --shard full: each rank's file holds its slices of the weights. The same layout resumes to the
// identical losses; one process puts the weights together from the slices; a checkpoint of whole
// weights (--shard gradients) resumes at full, each rank cutting its slices out of them.
TEST(DataParallel, FullyShardedCheckpointResumesInEveryLayout) {
  TempDir dir;
  const std::string common = "train --device cpu --model tiny --steps 4 --seq 32 --eval-rows 0 --quiet";
  const std::string full = common + " --batch 2 --shard full";
  const auto whole = launch(2, HEADROOM_BINARY, full + " --metrics " + dir.file("whole.jsonl"));
  ASSERT_EQ(whole.code, 0) << whole.out;
  const std::string ck = dir.file("ck"), ck_alone = dir.file("ck-alone"), ck_grads = dir.file("ck-grads");
  const auto first = launch(2, HEADROOM_BINARY, full + " --stop-at 2 --checkpoint " + ck);
  ASSERT_EQ(first.code, 0) << first.out;
  std::filesystem::create_directories(ck_alone);
  for (const char* f : {"manifest.json", "rank-0-of-2.hrc", "rank-1-of-2.hrc"}) {
    std::filesystem::copy_file(ck + "/" + f, ck_alone + "/" + f);
  }
  const auto grads =
      launch(2, HEADROOM_BINARY, common + " --batch 2 --shard gradients --stop-at 2 --checkpoint " + ck_grads);
  ASSERT_EQ(grads.code, 0) << grads.out;
  // A rank's file is about half the size of one holding the whole weights (the optimizer state is
  // sliced at both levels).
  EXPECT_LT(std::filesystem::file_size(ck + "/rank-0-of-2.hrc"),
            std::filesystem::file_size(ck_grads + "/rank-0-of-2.hrc") * 9 / 10);

  const auto a = read_jsonl(dir.file("whole.jsonl"));
  ASSERT_EQ(a.size(), 4u);
  const std::vector<Resume> resumes = {
      {"full", fmt::format("{} {} --resume {}", torchrun_prefix(), full, ck), 0.0},
      {"alone", fmt::format("env OMP_NUM_THREADS=1 {} {} --batch 4 --resume {}", HEADROOM_BINARY, common, ck_alone),
       1e-5},
      {"gradients into full", fmt::format("{} {} --resume {}", torchrun_prefix(), full, ck_grads), 1e-5},
  };
  expect_resumes(resumes, a, dir);
}

}  // namespace
}  // namespace headroom
