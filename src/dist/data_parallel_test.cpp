// Data-parallel training on 2 cpu ranks under torchrun (Gloo over loopback): the ranks' weights
// agree bit for bit, equal one process training the same global batch, the per-rank memory falls as
// each shard level says (against sizes computed here from the parameters' shapes), a dead or hung
// rank ends the other with an error within the timeout, and a sharded checkpoint resumes to the same
// loss sequence.
//
// The weights come from this test binary itself, launched by torchrun as the worker
// (DataParallelWorker.DISABLED_TrainsAndSavesItsWeights, which only runs when asked for by name).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "config/run_config.h"
#include "model/causal_lm.h"
#include "testing/command.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"
#include "train/oom_guard.h"
#include "train/run.h"
#include "util/error.h"

namespace headroom {
namespace {

using testing::read_jsonl;
using testing::run_command;
using testing::TempDir;

std::string torchrun() { return (std::filesystem::path(HEADROOM_PYTHON).parent_path() / "torchrun").string(); }

// `settings`: "key=value;key=value" in the flags' names.
RunConfig config_of(const std::string& settings) {
  RunConfig cfg;
  cfg.device = "cpu";
  cfg.quiet = true;
  cfg.eval_rows = 0;
  cfg.threads = 1;
  size_t begin = 0;
  while (begin < settings.size()) {
    size_t end = settings.find(';', begin);
    if (end == std::string::npos) end = settings.size();
    const std::string item = settings.substr(begin, end - begin);
    const size_t eq = item.find('=');
    for (const auto& f : run_fields()) {
      if (f.key == item.substr(0, eq)) f.set(cfg, item.substr(eq + 1));
    }
    begin = end + 1;
  }
  return cfg;
}

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

// Launches `ranks` local ranks of `program args` through torchrun; stdout and stderr together.
testing::CommandResult launch(int ranks, const std::string& program, const std::string& args,
                              const std::string& env = "") {
  return run_command(fmt::format("env OMP_NUM_THREADS=1 {} {} --standalone --no-python --nproc-per-node {} {} {} 2>&1",
                                 env, torchrun(), ranks, program, args));
}

// The start of a command line running the CLI on 2 local ranks.
std::string torchrun_prefix() {
  return fmt::format("env OMP_NUM_THREADS=1 {} --standalone --no-python --nproc-per-node 2 {}", torchrun(),
                     HEADROOM_BINARY);
}

std::string self() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

// The weights of each of 2 ranks trained on `settings` with --batch `batch`, and of one process
// training the same global batch (2 x batch) alone.
struct Weights {
  std::vector<float> rank0, rank1, alone;
};
Weights train_both_ways(const std::string& settings, int64_t batch) {
  TempDir dir;
  const auto r = launch(2, self(), "--gtest_also_run_disabled_tests --gtest_filter=DataParallelWorker.*",
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

// tiny: llama, untied, vocabulary 256; 2 micro-batches, weight decay and clipping on; momentum, whose
// update is linear in the gradient. (Adam's is not: where a gradient element is a sum that nearly
// cancels, the ranks' order of summation changes it relatively much, and Adam's normalised step
// turns that into a difference of up to the learning rate; its test compares losses.)
constexpr const char* kTiny = "model=tiny;steps=3;seq=32;accum=2;lr=0.01;optimizer=momentum;weight-decay=0.1";

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

// AdamW (the default) with its state sharded: the loss sequence of one process on the same global batch.
TEST(DataParallel, AdamWithShardedStateFollowsOneProcessLossSequence) {
  TempDir dir;
  const std::string common = "train --device cpu --model tiny --steps 4 --seq 32 --eval-rows 0 --quiet";
  const auto ranks = launch(2, HEADROOM_BINARY, common + " --batch 2 --shard optimizer --metrics " + dir.file("d.jsonl"));
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

// The per-rank memory of each shard level, from the monitor (the metrics' breakdown), against
// sizes computed here from the model's parameter shapes.
TEST(DataParallel, PerRankWeightGradientAndOptimizerBytesFollowTheShardLevel) {
  const RunConfig cfg = config_of(kTiny);
  const ModelConfig mc = load_model_config(cfg.model, cfg.overrides);
  const CausalLM model(mc, at::TensorOptions().dtype(at::kFloat), 1);
  int64_t weights = 0, chunks = 0, slices0 = 0, slices1 = 0, owned0 = 0, owned1 = 0, largest_chunk = 0;
  // --shard full gathers a unit at a time: the embeddings and head (unit 0), or one layer.
  std::map<int, int64_t> unit_bytes;
  const std::vector<int> units = model.parameter_units();
  for (size_t i = 0; i < units.size(); ++i) unit_bytes[units[i]] += 4 * model.parameters()[i].tensor.numel();
  int64_t largest_layer = 0;
  for (const auto& [unit, bytes] : unit_bytes) {
    if (unit > 0) largest_layer = std::max(largest_layer, bytes);
  }
  for (const auto& p : model.parameters()) {
    const int64_t n = p.tensor.numel(), c = (n + 1) / 2;
    weights += 4 * n;
    chunks += 4 * c;
    largest_chunk = std::max(largest_chunk, 4 * c);
    slices0 += std::min(c, n);
    slices1 += n - std::min(c, n);
    owned0 += 1;
    owned1 += n - c > 0 ? 1 : 0;
  }
  // adamw: exp_avg and exp_avg_sq per element, a float step counter per tensor it updates.
  const int64_t full_state = 8 * weights / 4 + 4 * static_cast<int64_t>(model.parameters().size());
  const int64_t state0 = 8 * slices0 + 4 * owned0, state1 = 8 * slices1 + 4 * owned1;

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
    // The collectives' buffers (the monitor's communication): unsharded, the one flat bucket all of
    // tiny's gradients fit in (under 25 MiB) at the update, and the 8-byte loss sum just before it,
    // which Gloo's worker thread may not have let go yet; sharded, in backward, the reduce-scatter of
    // a parameter or two at a time (its padded copy, its chunk, Gloo's copy: 5 chunks each).
    for (const auto* m : {&m0, &m1}) {
      const auto& phases = m->back().at("phases");
      if (l == "none") {
        const int64_t comm = phases.at("optimizer").at("breakdown").at("communication");
        EXPECT_GE(comm, weights);
        EXPECT_LE(comm, weights + 8);
      } else if (l != "optimizer") {
        const int64_t comm = phases.at("backward").at("breakdown").at("communication");
        EXPECT_GT(comm, 0);
        EXPECT_LE(comm, 2 * 5 * largest_chunk);
      }
    }
    if (l == "full") {
      // Between uses a rank holds its slices: 4 B × its elements; while the forward runs, the
      // embeddings and head too, and at most one layer besides.
      for (const int64_t rank : {0, 1}) {
        const auto& m = rank == 0 ? m0 : m1;
        const int64_t slices = 4 * (rank == 0 ? slices0 : slices1);
        const auto& update = m.back().at("phases").at("optimizer").at("breakdown");
        EXPECT_EQ(update.at("weights"), slices) << "rank " << rank;
        EXPECT_EQ(update.at("gradients"), chunks) << "rank " << rank;
        // At the forward's and backward's peaks (the gathered units counted as they were then,
        // though let go before the phase's end): the embeddings and head (kept until backward
        // has the embeddings' gradient, its last) and at most one layer besides.
        for (const char* phase : {"forward", "backward"}) {
          const int64_t gathered = m.back().at("phases").at(phase).at("breakdown").at("weights");
          EXPECT_GE(gathered, slices + unit_bytes[0]) << "rank " << rank << " " << phase;
          EXPECT_LE(gathered, slices + unit_bytes[0] + largest_layer) << "rank " << rank << " " << phase;
        }
      }
      EXPECT_EQ(m0.back().at("phases").at("optimizer").at("breakdown").at("optimizer"), state0);
      EXPECT_EQ(m1.back().at("phases").at("optimizer").at("breakdown").at("optimizer"), state1);
      continue;
    }
    for (const auto* m : {&m0, &m1}) {
      const auto& backward = m->back().at("phases").at("backward").at("breakdown");
      EXPECT_EQ(backward.at("weights"), weights);
      // Gradients alive at the end of backward: all of them unsharded; all of them and the shard
      // buffer (one chunk per parameter) at ZeRO-1, which reduces after backward; only the shard
      // at ZeRO-2, which reduced each as it was finished.
      const int64_t grads = l == "none" ? weights : l == "optimizer" ? weights + chunks : chunks;
      EXPECT_EQ(backward.at("gradients"), grads);
    }
    const auto& opt0 = m0.back().at("phases").at("optimizer").at("breakdown").at("optimizer");
    const auto& opt1 = m1.back().at("phases").at("optimizer").at("breakdown").at("optimizer");
    EXPECT_EQ(opt0, l == "none" ? full_state : state0);
    EXPECT_EQ(opt1, l == "none" ? full_state : state1);
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
  for (const Case& c : {Case{"--model gpt2 --set n_layer=2", 1},
                        Case{"--model pythia-160m --set num_hidden_layers=1", 1}, Case{"--model tiny", 2},
                        Case{"--model gpt2 --set n_layer=2 --optimizer adafactor", 1, {"gradients", "full"}}}) {
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
        EXPECT_NEAR(static_cast<double>(predicted), static_cast<double>(measured), 0.03 * static_cast<double>(measured));
      }
    }
  }
}

TEST(DataParallel, ShardedCheckpointResumesToTheSameLossSequence) {
  TempDir dir;
  const std::string common = fmt::format(
      "train --device cpu --model tiny --steps 4 --seq 32 --batch 2 --eval-rows 0 --quiet --shard gradients");
  const auto whole = launch(2, HEADROOM_BINARY, common + " --metrics " + dir.file("whole.jsonl"));
  ASSERT_EQ(whole.code, 0) << whole.out;
  const std::string ck = dir.file("ck");
  const auto first = launch(2, HEADROOM_BINARY,
                            common + " --stop-at 2 --checkpoint " + ck + " --metrics " + dir.file("parts.jsonl"));
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

// Two ranks launched by hand (rank 0 hosts the store); rank 1 is killed or stopped once training
// runs, and rank 0 must end with one line saying so, well within its timeout.
void expect_peer_loss_ends_the_other(const char* signal) {
  TempDir dir;
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  const std::string run = fmt::format(
      "env OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT={} WORLD_SIZE=2 {{}} {} train --device cpu --model "
      "tiny --steps 100000 --seq 32 --batch 2 --eval-rows 0 --quiet --dist-timeout 10 --metrics {}",
      port, HEADROOM_BINARY, dir.file("m.jsonl"));
  const std::string script = fmt::format(
      "RANK=0 {} 2>{} & P0=$!; RANK=1 {} 2>/dev/null & P1=$!; "
      // Once rank 0 has finished a step, the other goes.
      "for i in $(seq 600); do [ -s {} ] && break; sleep 0.1; done; kill -{} $P1; "
      "S=$(date +%s%N); wait $P0; RC=$?; E=$(date +%s%N); kill -9 $P1 2>/dev/null; "
      "echo \"rc=$RC ms=$(( (E - S) / 1000000 ))\"",
      fmt::format(fmt::runtime(run), "RANK=0"), dir.file("err"), fmt::format(fmt::runtime(run), "RANK=1"),
      dir.file("m.jsonl"), signal);
  std::ofstream(dir.file("s.sh")) << script;
  const auto r = run_command("bash " + dir.file("s.sh"));
  std::ifstream e(dir.file("err"));
  const std::string err((std::istreambuf_iterator<char>(e)), std::istreambuf_iterator<char>());
  int rc = -1, ms = -1;
  ASSERT_EQ(std::sscanf(r.out.c_str(), "rc=%d ms=%d", &rc, &ms), 2) << r.out;
  EXPECT_EQ(rc, kExitUsage) << err;
  EXPECT_LT(ms, 40'000) << "the 10 s timeout (and the time to report) was not kept";
  EXPECT_THAT(err, ::testing::HasSubstr("rank 0: lost contact with the other ranks"));
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
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
