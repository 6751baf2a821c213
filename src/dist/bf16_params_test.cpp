// --precision bf16-params (FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32))
// trained on 2 cpu ranks under torchrun with --shard full, and on one process: the loss against one
// process with the same precision, each rank's peak against bf16-mixed at the same shard level, and
// `estimate`'s allocated and reserved peaks against those measured under the cpu caching allocator.
// SmolLM-135M's widths and vocabulary (hidden 576, 49,152 tokens), 2 layers, tied and untied.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "dist/data_parallel_testing.h"
#include "testing/command.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"

namespace headroom {
namespace {

using data_parallel_testing::launch;
using data_parallel_testing::torchrun_launch;
using testing::read_jsonl;
using testing::run_command;
using testing::TempDir;

const std::string kShape =
    "--device cpu --model smollm-135m --set num_hidden_layers=2 --seq 64 --allocator caching "
    "--allocator-conf backend:native";

struct Measured {
  double final_loss = 0;
  double peak = 0, reserved = 0;  // the largest over every rank's steps
  double held = 0;                // live at the end of the last step's forward, on rank 0
};

// `ranks` ranks (1: a process alone) training 3 steps with `flags`; every rank's every step.
Measured train(int ranks, const std::string& flags) {
  TempDir dir;
  const std::string args = fmt::format("train {} {} --steps 3 --eval-rows 0 --quiet --json --metrics {} 2>/dev/null",
                                       kShape, flags, dir.file("m.jsonl"));
  const auto r = ranks == 1 ? run_command(fmt::format("env OMP_NUM_THREADS=1 {} {}", HEADROOM_BINARY, args))
                            : torchrun_launch(ranks, HEADROOM_BINARY, args);
  EXPECT_EQ(r.code, 0) << r.out;
  Measured m;
  m.final_loss = nlohmann::json::parse(r.out.substr(r.out.find('{'))).at("final_loss").get<double>();
  for (int k = 0; k < ranks; ++k) {
    const auto steps = read_jsonl(k == 0 ? dir.file("m.jsonl") : dir.file(fmt::format("m.rank{}.jsonl", k)));
    EXPECT_EQ(steps.size(), 3u) << "rank " << k;
    for (const auto& s : steps) {
      m.peak = std::max(m.peak, s.at("peak_bytes").get<double>());
      m.reserved = std::max(m.reserved, s.at("peak_reserved_bytes").get<double>());
      if (k == 0) m.held = s.at("phases").at("forward").at("live_out").get<double>();
    }
  }
  return m;
}

// The estimate's step peak (allocated) and its reserved peak, for the same flags.
std::pair<double, double> estimated(const std::string& flags) {
  const auto r = run_command(fmt::format("{} estimate {} {} --json --quiet", HEADROOM_BINARY, kShape, flags));
  EXPECT_EQ(r.code, 0) << r.out;
  const nlohmann::json e = nlohmann::json::parse(r.out);
  double step = 0;
  for (const auto& bytes : e.at("phases")) step = std::max(step, bytes.get<double>());
  return {step, e.at("peak_reserved_bytes").get<double>()};
}

void expect_estimated(const Measured& m, const std::string& flags) {
  const auto [peak, reserved] = estimated(flags);
  EXPECT_NEAR(peak, m.peak, 0.02 * m.peak) << flags;
  EXPECT_NEAR(reserved, m.reserved, 0.02 * m.reserved) << flags;
  std::printf("  %s: peak %.0f measured, %.0f estimated; reserved %.0f measured, %.0f estimated\n", flags.c_str(),
              m.peak, peak, m.reserved, reserved);
}

// 2 ranks of 2 rows at --shard full against one process of 4 rows, both bf16-params: the same global
// batch, the loss within bf16's rounding; each rank below bf16-mixed at --shard full (its layers
// gathered in float32, with autocast's bfloat16 copies beside them).
TEST(DataParallel, Bf16ParamsTrainsAsOneProcessBelowBf16Mixed) {
  const Measured fsdp = train(2, "--batch 2 --shard full --precision bf16-params");
  const Measured alone = train(1, "--batch 4 --precision bf16-params");
  const Measured mixed = train(2, "--batch 2 --shard full --precision bf16-mixed");
  EXPECT_NEAR(fsdp.final_loss, alone.final_loss, 2e-3);
  EXPECT_LT(fsdp.peak, mixed.peak);
  expect_estimated(fsdp, "--batch 2 --shard full --precision bf16-params --world-size 2");
  expect_estimated(alone, "--batch 4 --precision bf16-params");
  // Untied: the head a unit of its own weight, gathered and reduced apart from the embedding.
  const std::string untied = "--batch 2 --precision bf16-params --set tie_word_embeddings=false";
  expect_estimated(train(1, untied), untied);
}

// reshard_after_forward false keeps each layer's gathered bfloat16 weights from its forward to its
// backward: the forward ends holding both layers, which resharding had let go — by hand, 2 x
// 3,540,096 parameters (q, k, v, o, gate, up, down and two norms at SmolLM-135M's widths) x 2 bytes;
// the step's peak (the embedding's reduction, once backward let the layers go) as estimated.
TEST(DataParallel, Bf16ParamsWithoutReshardingKeepsTheLayersGathered) {
  const int64_t hidden = 576, kv = 3 * 64, inter = 1536;
  const int64_t layer = hidden * hidden * 2 + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden;
  const std::string flags = "--batch 2 --shard full --precision bf16-params --reshard-after-forward=false";
  const Measured kept = train(2, flags);
  const Measured resharded = train(2, "--batch 2 --shard full --precision bf16-params");
  EXPECT_EQ(kept.held - resharded.held, 2.0 * static_cast<double>(layer * 2));
  expect_estimated(kept, flags + " --world-size 2");
}

// torchtitan's defaults, FSDP2 with bf16 parameters and per-op checkpointing, on 2 ranks against one
// process with the same levers: the loss within bf16's rounding, each rank's peak and reserved bytes
// as estimated.
TEST(DataParallel, TorchtitansDefaultsTrainAsOneProcessAsEstimated) {
  const std::string levers = "--precision bf16-params --checkpointing ops";
  const Measured fsdp = train(2, "--batch 2 --shard full " + levers);
  const Measured alone = train(1, "--batch 4 " + levers);
  EXPECT_NEAR(fsdp.final_loss, alone.final_loss, 2e-3);
  expect_estimated(fsdp, "--batch 2 --shard full --world-size 2 " + levers);
}

// One process with bf16-params keeps its float32 weights as the slices of a group of one: a run
// stopped at step 2 with --checkpoint and resumed ends where the same run without a stop does, bit
// for bit; the checkpoint resumes into a plain float32 process too.
TEST(DataParallel, Bf16ParamsAloneResumesFromItsCheckpoint) {
  TempDir dir;
  const std::string run = fmt::format(
      "env OMP_NUM_THREADS=1 {} train --device cpu --model tiny --steps 4 --eval-rows 0 "
      "--quiet --json",
      HEADROOM_BINARY);
  auto final_loss = [](const testing::CommandResult& r) {
    EXPECT_EQ(r.code, 0) << r.out;
    return nlohmann::json::parse(r.out.substr(r.out.rfind('{'))).at("final_loss").get<double>();
  };
  const double straight = final_loss(run_command(run + " --precision bf16-params"));
  ASSERT_EQ(
      run_command(fmt::format("{} --precision bf16-params --stop-at 2 --checkpoint {}", run, dir.file("ck"))).code, 0);
  EXPECT_EQ(
      final_loss(run_command(fmt::format("{} --precision bf16-params --resume {} 2>/dev/null", run, dir.file("ck")))),
      straight);
  ASSERT_EQ(
      run_command(fmt::format("{} --precision bf16-params --stop-at 2 --checkpoint {}", run, dir.file("ck2"))).code, 0);
  EXPECT_NEAR(final_loss(run_command(fmt::format("{} --resume {} 2>/dev/null", run, dir.file("ck2")))), straight, 0.05);
}

}  // namespace
}  // namespace headroom
