// Data-parallel training on 2 cpu ranks under torchrun (Gloo over loopback): the ranks' weights
// agree bit for bit and equal one process training the same global batch; a dead or hung rank ends
// the other with an error within the timeout, and an OOM on one rank is recovered by all together.
// (Sharded checkpoints: data_parallel_checkpoint_test.cpp; per-rank memory and its estimate:
// data_parallel_memory_test.cpp.)
//
// The weights come from this test binary itself, launched by torchrun as the worker
// (DataParallelWorker.DISABLED_TrainsAndSavesItsWeights, which only runs when asked for by name).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "config/run_config.h"
#include "dist/data_parallel_testing.h"
#include "testing/command.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"
#include "train/oom_guard.h"
#include "train/run.h"
#include "util/error.h"

namespace headroom {
namespace {

using data_parallel_testing::config_of;
using data_parallel_testing::kTiny;
using data_parallel_testing::launch;
using data_parallel_testing::torchrun_launch;
using testing::read_jsonl;
using testing::run_command;
using testing::TempDir;

// Trains `cfg` (guarded, as the trainer does) and returns every parameter, flattened, in float32.
std::vector<float> train_weights(const RunConfig& cfg) {
  MadeRun made = make_run(cfg);
  if (!made.run) throw std::runtime_error("setup ran out of memory");
  Run& run = *made.run;
  OomGuard guard(run);
  for (int64_t step = 0; step < cfg.steps; ++step) {
    const GuardedStep g = guard.run(step);
    if (g.oom) throw std::runtime_error("step ran out of memory");
    run.monitor->end_step();
  }
  // --shard full: the parameters hold nothing between uses; gathered whole from the ranks' slices.
  if (ParameterGate* gate = run.replicas ? run.replicas->gate() : nullptr) {
    const std::vector<int> units = run.model->parameter_units();
    for (int u = 0; u <= *std::max_element(units.begin(), units.end()); ++u) gate->gather(u);
  }
  std::vector<at::Tensor> flat;
  for (const auto& p : run.parameters()) flat.push_back(p.tensor.detach().reshape(-1).to(at::kFloat));
  const at::Tensor all = at::cat(flat).contiguous();
  return std::vector<float>(all.data_ptr<float>(), all.data_ptr<float>() + all.numel());
}

std::vector<float> read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

// The worker: trains HEADROOM_TEST_RUN's configuration on this rank and writes its weights to
// HEADROOM_TEST_OUT/rank<R>.bin.
TEST(DataParallelWorker, DISABLED_TrainsAndSavesItsWeights) {
  const char* settings = std::getenv("HEADROOM_TEST_RUN");
  const char* out = std::getenv("HEADROOM_TEST_OUT");
  const char* rank = std::getenv("RANK");
  ASSERT_TRUE(settings && out && rank) << "launched by DataParallel tests through torchrun only";
  const std::vector<float> w = train_weights(config_of(settings));
  std::ofstream f(fmt::format("{}/rank{}.bin", out, rank), std::ios::binary);
  f.write(reinterpret_cast<const char*>(w.data()), static_cast<std::streamsize>(w.size() * sizeof(float)));
}

std::string self() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

// The weights of each of 2 ranks trained on `settings` with --batch `batch`, and of one process
// training the same global batch (2 x batch) alone.
struct Weights {
  std::vector<float> rank0, rank1, alone;
};
Weights train_both_ways(const std::string& settings, int64_t batch) {
  TempDir dir;
  const auto r =
      torchrun_launch(2, self(), "--gtest_also_run_disabled_tests --gtest_filter=DataParallelWorker.*",
             fmt::format("HEADROOM_TEST_RUN='{};batch={}' HEADROOM_TEST_OUT={}", settings, batch, dir.path()));
  EXPECT_EQ(r.code, 0) << r.out;
  Weights w{read_floats(dir.file("rank0.bin")), read_floats(dir.file("rank1.bin")), {}};
  w.alone = train_weights(config_of(fmt::format("{};batch={}", settings, 2 * batch)));
  return w;
}

void expect_agreement(const Weights& w) {
  ASSERT_EQ(w.rank0.size(), w.alone.size());
  ASSERT_EQ(w.rank1.size(), w.alone.size());
  EXPECT_EQ(std::memcmp(w.rank0.data(), w.rank1.data(), w.rank0.size() * sizeof(float)), 0)
      << "the ranks' weights differ";
  float worst = 0;
  for (size_t i = 0; i < w.alone.size(); ++i) worst = std::max(worst, std::abs(w.rank0[i] - w.alone[i]));
  EXPECT_LT(worst, 1e-5f) << "largest difference from one process training the same global batch";
  // And training happened: the weights moved from their initialisation by more than that.
  EXPECT_GT(worst, 0.0f);
}

TEST(DataParallel, UnshardedRanksAgreeBitwiseAndMatchOneProcess) {
  expect_agreement(train_both_ways(std::string(kTiny) + ";shard=none", 2));
}

TEST(DataParallel, OptimizerShardedRanksAgreeBitwiseAndMatchOneProcess) {
  expect_agreement(train_both_ways(std::string(kTiny) + ";shard=optimizer", 2));
}

TEST(DataParallel, GradientShardedRanksAgreeBitwiseAndMatchOneProcess) {
  expect_agreement(train_both_ways(std::string(kTiny) + ";shard=gradients", 2));
}

TEST(DataParallel, FullyShardedRanksAgreeBitwiseAndMatchOneProcess) {
  expect_agreement(train_both_ways(std::string(kTiny) + ";shard=full", 2));
}

// Each layer checkpointed: backward recomputes a layer's forward, which must find its weights gathered.
TEST(DataParallel, FullyShardedWithCheckpointedLayersMatchesOneProcess) {
  expect_agreement(train_both_ways(std::string(kTiny) + ";shard=full;checkpointing=full", 2));
}

// gpt2's real widths and vocabulary, at one layer: tied embeddings (one tensor used twice, whose
// gradient is complete only at the end of backward), dropout off so that one process and two ranks
// draw nothing differently.
TEST(DataParallel, TiedGpt2AgreesWhenGradientsAreSharded) {
  const std::string gpt2 =
      "model=gpt2;set=n_layer=1;set=embd_pdrop=0;set=attn_pdrop=0;set=resid_pdrop=0;steps=2;seq=16;"
      "optimizer=momentum;lr=0.01;shard=";
  for (const char* level : {"gradients", "full"}) {
    SCOPED_TRACE(level);
    expect_agreement(train_both_ways(gpt2 + level, 1));
  }
}

// Adafactor shards by the same slices, which start and end inside a matrix's rows: the ranks sum
// their parts of each row's and column's statistics, so each updates its slice as one process would.
TEST(DataParallel, AdafactorShardedRanksAgreeBitwiseAndMatchOneProcess) {
  for (const char* level : {"optimizer", "full"}) {
    SCOPED_TRACE(level);
    expect_agreement(train_both_ways(
        fmt::format("model=tiny;steps=3;seq=32;accum=2;lr=0.01;optimizer=adafactor;weight-decay=0.1;shard={}", level),
        2));
  }
}

// AdamW (the default) with its state sharded: the loss sequence of one process on the same global batch.
TEST(DataParallel, AdamWithShardedStateFollowsOneProcessLossSequence) {
  TempDir dir;
  const std::string common = "train --device cpu --model tiny --steps 4 --seq 32 --eval-rows 0 --quiet";
  const auto ranks =
      launch(2, HEADROOM_BINARY, common + " --batch 2 --shard optimizer --metrics " + dir.file("d.jsonl"));
  ASSERT_EQ(ranks.code, 0) << ranks.out;
  const auto alone = run_command(fmt::format("env OMP_NUM_THREADS=1 {} {} --batch 4 --metrics {} 2>&1", HEADROOM_BINARY,
                                             common, dir.file("s.jsonl")));
  ASSERT_EQ(alone.code, 0) << alone.out;
  const auto d = read_jsonl(dir.file("d.jsonl")), s = read_jsonl(dir.file("s.jsonl"));
  ASSERT_EQ(d.size(), 4u);
  ASSERT_EQ(s.size(), 4u);
  for (size_t i = 0; i < d.size(); ++i) {
    EXPECT_NEAR(d[i].at("loss").get<double>(), s[i].at("loss").get<double>(), 1e-5) << "step " << i + 1;
    EXPECT_EQ(d[i].at("tokens"), s[i].at("tokens"));  // the global batch's, on both
  }
}

// Rank 1 is killed or stopped once training runs, and rank 0 must end with one line saying so, well
// within its timeout.
void expect_peer_loss_ends_the_other(const char* signal) {
  const data_parallel_testing::PeerLoss r = data_parallel_testing::lose_peer("", signal);
  ASSERT_GE(r.ms, 0) << r.script_out;
  EXPECT_EQ(r.rc, kExitUsage) << r.err;
  EXPECT_LT(r.ms, 40'000) << "the 10 s timeout (and the time to report) was not kept";
  EXPECT_THAT(r.err, ::testing::HasSubstr("rank 0: lost contact with the other ranks"));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(DataParallel, AKilledRankEndsTheOtherWithAnError) { expect_peer_loss_ends_the_other("KILL"); }
TEST(DataParallel, AStoppedRankEndsTheOtherAtTheTimeout) { expect_peer_loss_ends_the_other("STOP"); }

// An OOM on one rank only: every rank runs the step again with half the micro-batch, and the
// result is the run without the OOM. At full the failed rank replays the rest of the micro-batch's
// gathers and reductions, whose order it knows from the step before, or in the first step from the
// rehearsal.
TEST(DataParallel, AnOomOnOneRankIsRecoveredByAllTogether) {
  struct Case {
    const char* level;
    int step;
  };
  for (const Case c : {Case{"none", 2}, Case{"gradients", 2}, Case{"full", 2}, Case{"full", 1}}) {
    SCOPED_TRACE(fmt::format("--shard {}, step {}", c.level, c.step));
    TempDir dir;
    const std::string common = fmt::format(
        "train --device cpu --model tiny --steps 3 --seq 32 --batch 4 --eval-rows 0 --quiet --json --shard {}",
        c.level);
    const auto clean = launch(2, HEADROOM_BINARY, common + " --metrics " + dir.file("a.jsonl"));
    const auto hit = launch(2, HEADROOM_BINARY,
                            fmt::format("{} --inject-oom {}:60@1 --metrics {}", common, c.step, dir.file("b.jsonl")));
    ASSERT_EQ(clean.code, 0) << clean.out;
    ASSERT_EQ(hit.code, 0) << hit.out;
    const auto a = read_jsonl(dir.file("a.jsonl")), b = read_jsonl(dir.file("b.jsonl"));
    const auto b1 = read_jsonl(dir.file("b.rank1.jsonl"));
    ASSERT_EQ(b.size(), 3u);
    const auto k = static_cast<size_t>(c.step - 1);
    EXPECT_EQ(b[k].at("oom_recoveries"), 1);
    EXPECT_EQ(b[k].at("batch"), 2);  // on both ranks
    EXPECT_EQ(b1[k].at("batch"), 2);
    EXPECT_NEAR(b.back().at("loss").get<double>(), a.back().at("loss").get<double>(), 1e-5);
  }
}

}  // namespace
}  // namespace headroom
