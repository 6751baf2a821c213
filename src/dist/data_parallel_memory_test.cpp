// The per-rank memory of data-parallel training on 2 cpu ranks under torchrun: each shard level's
// weights, gradients, optimizer state and collectives' buffers against sizes computed here from the
// parameters' shapes, and `estimate --world-size 2`'s peak against the one measured.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "dist/data_parallel_testing.h"
#include "model/causal_lm.h"
#include "testing/command.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"

namespace headroom {
namespace {

using data_parallel_testing::config_of;
using data_parallel_testing::kTiny;
using data_parallel_testing::launch;
using testing::read_jsonl;
using testing::run_command;
using testing::TempDir;

// tiny's bytes per rank on 2 ranks, computed from its parameters' shapes (float32): what each shard
// level's breakdown must show.
struct ShardSizes {
  int64_t weights = 0;  // every parameter whole
  int64_t chunks = 0;   // one chunk per parameter (the shard gradient buffer)
  int64_t largest_chunk = 0;
  int64_t slices0 = 0, slices1 = 0;  // elements of each rank's slices
  int64_t embeddings_and_head = 0;   // unit 0, as --shard full gathers it
  int64_t largest_layer = 0;         // the largest other unit
  int64_t full_state = 0;            // adamw's state unsharded
  int64_t state0 = 0, state1 = 0;    // and each rank's share
};

ShardSizes shard_sizes(const RunConfig& cfg) {
  const ModelConfig mc = load_model_config(cfg.model, cfg.overrides);
  const CausalLM model(mc, at::TensorOptions().dtype(at::kFloat), 1);
  ShardSizes z;
  int64_t owned0 = 0, owned1 = 0;
  // --shard full gathers a unit at a time: the embeddings and head (unit 0), or one layer.
  std::map<int, int64_t> unit_bytes;
  const std::vector<int> units = model.parameter_units();
  for (size_t i = 0; i < units.size(); ++i) unit_bytes[units[i]] += 4 * model.parameters()[i].tensor.numel();
  for (const auto& [unit, bytes] : unit_bytes) {
    if (unit > 0) z.largest_layer = std::max(z.largest_layer, bytes);
  }
  z.embeddings_and_head = unit_bytes[0];
  for (const auto& p : model.parameters()) {
    const int64_t n = p.tensor.numel(), c = (n + 1) / 2;
    z.weights += 4 * n;
    z.chunks += 4 * c;
    z.largest_chunk = std::max(z.largest_chunk, 4 * c);
    z.slices0 += std::min(c, n);
    z.slices1 += n - std::min(c, n);
    owned0 += 1;
    owned1 += n - c > 0 ? 1 : 0;
  }
  // adamw: exp_avg and exp_avg_sq per element, a float step counter per tensor it updates.
  z.full_state = 8 * z.weights / 4 + 4 * static_cast<int64_t>(model.parameters().size());
  z.state0 = 8 * z.slices0 + 4 * owned0;
  z.state1 = 8 * z.slices1 + 4 * owned1;
  return z;
}

using Metrics = std::vector<nlohmann::json>;

// The collectives' buffers (the monitor's communication): unsharded, the one flat bucket all of
// tiny's gradients fit in (under 25 MiB) at the update, and the 8-byte loss sum just before it,
// which Gloo's worker thread may not have let go yet; sharded, in backward, the reduce-scatter of
// a parameter or two at a time (its padded copy, its chunk, Gloo's copy: 5 chunks each).
void expect_communication_buffers(const std::string& l, const Metrics& m0, const Metrics& m1, const ShardSizes& z) {
  for (const auto* m : {&m0, &m1}) {
    const auto& phases = m->back().at("phases");
    if (l == "none") {
      const int64_t comm = phases.at("optimizer").at("breakdown").at("communication");
      EXPECT_GE(comm, z.weights);
      EXPECT_LE(comm, z.weights + 8);
    } else if (l != "optimizer") {
      const int64_t comm = phases.at("backward").at("breakdown").at("communication");
      EXPECT_GT(comm, 0);
      EXPECT_LE(comm, 2 * 5 * z.largest_chunk);
    }
  }
}

// --shard full: between uses a rank holds its slices: 4 B × its elements; while the forward runs,
// the embeddings and head too, and at most one layer besides.
void expect_fully_sharded_bytes(const Metrics& m0, const Metrics& m1, const ShardSizes& z) {
  for (const int64_t rank : {0, 1}) {
    const auto& m = rank == 0 ? m0 : m1;
    const int64_t slices = 4 * (rank == 0 ? z.slices0 : z.slices1);
    const auto& update = m.back().at("phases").at("optimizer").at("breakdown");
    EXPECT_EQ(update.at("weights"), slices) << "rank " << rank;
    EXPECT_EQ(update.at("gradients"), z.chunks) << "rank " << rank;
    // At the forward's and backward's peaks (the gathered units counted as they were then,
    // though let go before the phase's end): the embeddings and head (kept until backward
    // has the embeddings' gradient, its last) and at most one layer besides.
    for (const char* phase : {"forward", "backward"}) {
      const int64_t gathered = m.back().at("phases").at(phase).at("breakdown").at("weights");
      EXPECT_GE(gathered, slices + z.embeddings_and_head) << "rank " << rank << " " << phase;
      EXPECT_LE(gathered, slices + z.embeddings_and_head + z.largest_layer) << "rank " << rank << " " << phase;
    }
  }
  EXPECT_EQ(m0.back().at("phases").at("optimizer").at("breakdown").at("optimizer"), z.state0);
  EXPECT_EQ(m1.back().at("phases").at("optimizer").at("breakdown").at("optimizer"), z.state1);
}

// --shard none, optimizer or gradients: the weights whole on every rank; the gradients and the
// optimizer state as the level shards them.
void expect_whole_weights_bytes(const std::string& l, const Metrics& m0, const Metrics& m1, const ShardSizes& z) {
  for (const auto* m : {&m0, &m1}) {
    const auto& backward = m->back().at("phases").at("backward").at("breakdown");
    EXPECT_EQ(backward.at("weights"), z.weights);
    // Gradients alive at the end of backward: all of them unsharded; all of them and the shard
    // buffer (one chunk per parameter) at ZeRO-1, which reduces after backward; only the shard
    // at ZeRO-2, which reduced each as it was finished.
    const int64_t grads = l == "none" ? z.weights : l == "optimizer" ? z.weights + z.chunks : z.chunks;
    EXPECT_EQ(backward.at("gradients"), grads);
  }
  const auto& opt0 = m0.back().at("phases").at("optimizer").at("breakdown").at("optimizer");
  const auto& opt1 = m1.back().at("phases").at("optimizer").at("breakdown").at("optimizer");
  EXPECT_EQ(opt0, l == "none" ? z.full_state : z.state0);
  EXPECT_EQ(opt1, l == "none" ? z.full_state : z.state1);
}

// The per-rank memory of each shard level, from the monitor (the metrics' breakdown), against
// sizes computed here from the model's parameter shapes.
TEST(DataParallel, PerRankWeightGradientAndOptimizerBytesFollowTheShardLevel) {
  const ShardSizes z = shard_sizes(config_of(kTiny));
  for (const char* level : {"none", "optimizer", "gradients", "full"}) {
    SCOPED_TRACE(level);
    TempDir dir;
    const auto r = launch(2, HEADROOM_BINARY,
                          fmt::format("train --device cpu --model tiny --steps 2 --seq 32 --accum 2 --batch 2 "
                                      "--eval-rows 0 --quiet --shard {} --metrics {}",
                                      level, dir.file("m.jsonl")));
    ASSERT_EQ(r.code, 0) << r.out;
    const auto m0 = read_jsonl(dir.file("m.jsonl")), m1 = read_jsonl(dir.file("m.rank1.jsonl"));
    ASSERT_EQ(m0.size(), 2u);
    ASSERT_EQ(m1.size(), 2u);
    EXPECT_EQ(m0.back().at("rank"), 0);
    EXPECT_EQ(m1.back().at("rank"), 1);
    const std::string l = level;
    expect_communication_buffers(l, m0, m1, z);
    if (l == "full") {
      expect_fully_sharded_bytes(m0, m1, z);
    } else {
      expect_whole_weights_bytes(l, m0, m1, z);
    }
  }
}

// `estimate --world-size 2 --shard S` against rank peaks measured on 2 ranks: gpt2's widths and
// vocabulary at two layers (tied embeddings), pythia-160m's at one (gpt_neox, an untied head of
// gpt2's size, whose reduce-scatter makes the peak), and tiny (llama, untied) at its four; adafactor
// (its slices' scratch and the whole factored moments) on gpt2 where the weights and gradients shard.
TEST(DataParallel, EstimatePerRankPeakWithinThreePercentOfTheMeasuredOne) {
  struct Case {
    std::string model;
    int64_t batch;
    std::vector<const char*> levels = {"none", "optimizer", "gradients", "full"};
  };
  // Every level on tied gpt2 (its gathered embedding makes full peak above gradients); the untied,
  // the small and the factored optimizer's at the levels that differ most for them.
  for (const Case& c : {Case{"--model gpt2 --set n_layer=2", 1},
                        Case{"--model pythia-160m --set num_hidden_layers=1", 1, {"optimizer", "full"}},
                        Case{"--model tiny", 2, {"none", "gradients"}},
                        Case{"--model gpt2 --set n_layer=2 --optimizer adafactor", 1, {"full"}}}) {
    for (const char* level : c.levels) {
      SCOPED_TRACE(c.model + " --shard " + level);
      const std::string shape = fmt::format("{} --batch {} --seq 32 --device cpu --shard {}", c.model, c.batch, level);
      const auto e = run_command(fmt::format("{} estimate {} --world-size 2 --json", HEADROOM_BINARY, shape));
      ASSERT_EQ(e.code, 0) << e.out;
      const int64_t predicted = nlohmann::json::parse(e.out).at("peak_bytes");
      const auto m = launch(2, HEADROOM_BINARY, fmt::format("train {} --steps 2 --eval-rows 0 --quiet --json", shape));
      ASSERT_EQ(m.code, 0) << m.out;
      const auto summary = nlohmann::json::parse(m.out.substr(m.out.rfind("\n{") + 1));
      for (const int64_t measured : summary.at("rank_peak_bytes").get<std::vector<int64_t>>()) {
        EXPECT_NEAR(static_cast<double>(predicted), static_cast<double>(measured),
                    0.03 * static_cast<double>(measured));
      }
    }
  }
}

// A wide MLP (hidden 1024, intermediate 2816: several 25 MiB buckets unsharded, a reduce-scatter of
// 11 MiB matrices sharded) on 2 ranks: every rank's every step has the estimated peak, to 0.01%.
// Gloo's worker lets go of a finished collective a moment after the wait returns; before the
// communicator waited for that, the next bucket was sometimes allocated beside the last, and a
// rank's step (which one, run to run) peaked 2.9% above the estimate here.
TEST(DataParallel, EveryRankAndStepOfAWideMlpHasTheEstimatedPeak) {
  for (const char* level : {"none", "gradients"}) {
    SCOPED_TRACE(level);
    TempDir dir;
    const std::string shape = fmt::format(
        "--model tiny --set num_hidden_layers=2 --set hidden_size=1024 --set intermediate_size=2816 --batch 4 "
        "--seq 128 --device cpu --shard {}",
        level);
    const auto e = run_command(fmt::format("{} estimate {} --world-size 2 --json", HEADROOM_BINARY, shape));
    ASSERT_EQ(e.code, 0) << e.out;
    const int64_t predicted = nlohmann::json::parse(e.out).at("peak_bytes");
    const auto m = launch(2, HEADROOM_BINARY,
                          fmt::format("train {} --steps 3 --eval-rows 0 --quiet --metrics {}", shape, dir.file("m.jsonl")));
    ASSERT_EQ(m.code, 0) << m.out;
    for (const char* file : {"m.jsonl", "m.rank1.jsonl"}) {
      const auto steps = read_jsonl(dir.file(file));
      ASSERT_EQ(steps.size(), 3u) << file;
      for (const auto& step : steps) {
        const int64_t measured = step.at("peak_bytes");
        EXPECT_NEAR(static_cast<double>(predicted), static_cast<double>(measured), 1e-4 * static_cast<double>(measured))
            << file << " step " << step.at("step");
      }
    }
  }
}

}  // namespace
}  // namespace headroom
