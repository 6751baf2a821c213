// Pipeline stages: the 1F1B schedule, a model cut into stages that equals the whole model, and
// training on 2 and 4 cpu ranks under torchrun (Gloo over loopback) against one process training
// the same global batch.
//
// The weights come from this test binary itself, launched by torchrun as the worker
// (PipelineWorker.DISABLED_TrainsAndSavesItsStage, which only runs when asked for by name).
#include "dist/pipeline.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "config/model_config.h"
#include "dist/data_parallel_testing.h"
#include "model/parameter_gate.h"
#include "testing/command.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"
#include "train/oom_guard.h"
#include "train/run.h"
#include "util/error.h"

namespace headroom {
namespace {

using data_parallel_testing::config_of;
using data_parallel_testing::launch;
using data_parallel_testing::torchrun_launch;
using testing::read_jsonl;
using testing::run_command;
using testing::TempDir;

// Every stage's schedule run together, sends arriving at once and receives waiting for them: all
// of them finish (no stage waits for one that waits for it), each stage runs every micro-batch's
// forward and backward once, and stage s never holds more than min(p - s, m) micro-batches.
TEST(OneFOneB, EveryStageFinishesAndHoldsAtMostItsShare) {
  for (int64_t p : {1, 2, 3, 4, 8}) {
    for (int64_t m : {1, 2, 3, 4, 7, 16}) {
      SCOPED_TRACE(fmt::format("{} stages, {} micro-batches", p, m));
      std::vector<std::vector<PipelineSlot>> plan;
      for (int64_t s = 0; s < p; ++s) plan.push_back(one_f_one_b(s, p, m));
      // activations[s][k]: micro-batch k's output of stage s has been sent; gradients[s][k]: its
      // input's gradient.
      std::vector<std::vector<bool>> activations(p, std::vector<bool>(m, false)), gradients = activations;
      std::vector<size_t> next(p, 0);
      std::vector<int64_t> held(p, 0), most(p, 0);
      for (bool moved = true; moved;) {
        moved = false;
        for (int64_t s = 0; s < p; ++s) {
          if (next[s] == plan[s].size()) continue;
          const PipelineSlot slot = plan[s][next[s]];
          const bool ready = slot.forward ? (s == 0 || activations[s - 1][slot.micro])
                                          : (s == p - 1 || gradients[s + 1][slot.micro]);
          if (!ready) continue;
          (slot.forward ? activations : gradients)[s][slot.micro] = true;
          held[s] += slot.forward ? 1 : -1;
          most[s] = std::max(most[s], held[s]);
          ++next[s];
          moved = true;
        }
      }
      for (int64_t s = 0; s < p; ++s) {
        EXPECT_EQ(next[s], static_cast<size_t>(2 * m)) << "stage " << s << " is stuck";
        EXPECT_EQ(held[s], 0);
        EXPECT_EQ(most[s], std::min(p - s, m)) << "stage " << s;
        for (int64_t k = 0; k < m; ++k) EXPECT_TRUE(activations[s][k] && gradients[s][k]);
      }
    }
  }
}

// GPT-2's width and vocabulary (tied) and Llama-style untied tiny: the stages' parameters are the
// whole model's of the same seed, and their forwards chained give the whole model's logits.
TEST(ModelStages, ChainedStagesAreTheWholeModel) {
  const std::map<std::string, std::vector<std::string>> models = {
      {"gpt2", {"n_layer=3", "resid_pdrop=0", "embd_pdrop=0", "attn_pdrop=0"}}, {"tiny", {"num_hidden_layers=3"}}};
  for (const auto& [name, overrides] : models) {
    SCOPED_TRACE(name);
    const ModelConfig c = load_model_config(name, overrides);
    const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
    const CausalLM whole(c, f32, 7);
    std::map<std::string, at::Tensor> by_name;
    for (const NamedTensor& p : whole.parameters()) by_name[p.name] = p.tensor;
    const std::vector<ModelStage> stages = {{0, 1, true, false}, {1, 2, false, false}, {2, 3, false, true}};
    std::vector<std::unique_ptr<CausalLM>> parts;
    int64_t counted = 0;
    for (const ModelStage& s : stages) {
      parts.push_back(std::make_unique<CausalLM>(c, f32, 7, CausalLM::KeepParameter{}, Finetune{}, true,
                                                 BaseWeights::dense, s));
      for (const NamedTensor& p : parts.back()->parameters()) {
        ASSERT_EQ(by_name.count(p.name), 1u) << p.name;
        EXPECT_TRUE(at::equal(p.tensor, by_name[p.name])) << p.name;
        counted += p.tensor.numel();
      }
    }
    // Each parameter on one stage, but a tied embedding on two (the last stage's head).
    EXPECT_EQ(counted, whole.num_parameters() + (c.tie_word_embeddings ? c.vocab_size * c.hidden_size : 0));
    EXPECT_EQ(parts.back()->head_weight().sizes(), (std::vector<int64_t>{c.vocab_size, c.hidden_size}));
    const c10::NoGradGuard no_grad;
    const at::Tensor ids = at::randint(c.vocab_size, {2, 16}, at::TensorOptions().dtype(at::kLong));
    const ForwardOptions o{AttentionPath::flash, /*training=*/false};
    at::Tensor x = ids;
    for (const auto& part : parts) x = part->hidden_states(x, o);
    const at::Tensor logits = at::linear(x, parts.back()->head_weight());
    EXPECT_TRUE(at::equal(logits, whole.forward(ids, o)));
  }
}

// The worker: trains HEADROOM_TEST_RUN's configuration on this rank and writes each of its stage's
// parameters to HEADROOM_TEST_OUT/rank<R>/<name> (--shard full: gathered from the stage's ranks first).
void save_parameters(const Run& run, const std::string& dir) {
  std::filesystem::create_directories(dir);
  if (ParameterGate* gate = run.forward.gate) {
    for (const int unit : run.model->parameter_units()) gate->gather(unit);
  }
  for (const NamedTensor& p : run.parameters()) {
    const at::Tensor t = p.tensor.detach().reshape(-1).to(at::kFloat).contiguous();
    std::ofstream(dir + "/" + p.name, std::ios::binary)
        .write(reinterpret_cast<const char*>(t.data_ptr<float>()), static_cast<std::streamsize>(t.numel() * 4));
  }
}

void train(const RunConfig& cfg, const std::string& out) {
  MadeRun made = make_run(cfg);
  ASSERT_TRUE(made.run) << "setup ran out of memory";
  Run& run = *made.run;
  OomGuard guard(run);
  for (int64_t step = 0; step < cfg.steps; ++step) {
    const GuardedStep g = guard.run(step);
    ASSERT_FALSE(g.oom) << "step ran out of memory";
    run.monitor->end_step();
  }
  save_parameters(run, out);
}

TEST(PipelineWorker, DISABLED_TrainsAndSavesItsStage) {
  const char* settings = std::getenv("HEADROOM_TEST_RUN");
  const char* out = std::getenv("HEADROOM_TEST_OUT");
  const char* rank = std::getenv("RANK");
  ASSERT_TRUE(settings && out && rank) << "launched by Pipeline tests through torchrun only";
  train(config_of(settings), fmt::format("{}/rank{}", out, rank));
}

std::string self() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

std::vector<float> read_floats(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

// Trains `settings` on `stages` ranks with --pipeline and in one process, and compares every
// parameter each stage holds with the one process's of the same name: the largest difference.
// Every parameter must be held by some stage; a tied embedding's two copies must be equal bitwise.
// With `ranks` a multiple of `stages`, each stage is trained by ranks / stages data-parallel ranks,
// and `alone` is the one process's settings (the same global batch). `alone_dir`, when given, holds
// the one process's weights already (train's output), which several layouts compare with.
float largest_difference(const std::string& settings, int stages, int ranks = 0, const std::string& alone_settings = "",
                         const std::string& alone_dir = "") {
  if (ranks == 0) ranks = stages;
  TempDir dir;
  const auto r = torchrun_launch(ranks, self(), "--gtest_also_run_disabled_tests --gtest_filter=PipelineWorker.*",
                        fmt::format("HEADROOM_TEST_RUN='{};pipeline={}' HEADROOM_TEST_OUT={}", settings, stages,
                                    dir.path()));
  EXPECT_EQ(r.code, 0) << r.out;
  const std::string alone = alone_dir.empty() ? dir.file("alone") : alone_dir;
  if (alone_dir.empty()) train(config_of(alone_settings.empty() ? settings : alone_settings), alone);
  namespace fs = std::filesystem;
  float worst = 0;
  std::map<std::string, std::vector<float>> seen;
  for (const auto& param : fs::directory_iterator(alone)) {
    const std::string name = param.path().filename().string();
    const std::vector<float> alone = read_floats(param.path());
    int holders = 0;
    for (int s = 0; s < ranks; ++s) {
      const fs::path mine = fs::path(dir.file(fmt::format("rank{}", s))) / name;
      if (!fs::exists(mine)) continue;
      ++holders;
      const std::vector<float> w = read_floats(mine);
      EXPECT_EQ(w.size(), alone.size()) << name;
      if (w.size() != alone.size()) continue;
      for (size_t i = 0; i < w.size(); ++i) worst = std::max(worst, std::abs(w[i] - alone[i]));
      if (auto [it, first] = seen.emplace(name, w); !first) {
        EXPECT_EQ(it->second, w) << name << ": the stages' copies differ";
      }
    }
    EXPECT_GE(holders, 1) << name << " is on no stage";
  }
  EXPECT_FALSE(seen.empty());
  return worst;
}

// tiny (llama, untied), 4 micro-batches, momentum, no clipping: every gradient is the same sum in the
// same order as one process's, so the weights are equal bitwise; with clipping, the global norm is
// summed per stage first, and they differ in the last bits.
TEST(Pipeline, TwoStagesTrainAsOneProcessBitwise) {
  const std::string tiny = "model=tiny;steps=3;seq=32;batch=2;accum=4;lr=0.01;optimizer=momentum;weight-decay=0.1";
  EXPECT_EQ(largest_difference(tiny + ";grad-clip=0", 2), 0.0f);
  EXPECT_LT(largest_difference(tiny, 2), 1e-6f);
}

// GPT-2's width and vocabulary, tied, 4 layers on 4 stages (two of them in the middle, receiving and
// sending both ways): the head's copy of the embedding stays equal to the embedding, and the weights
// follow one process's.
TEST(Pipeline, FourStagesOfATiedModelMatchOneProcess) {
  const std::string gpt2 =
      "model=gpt2;set=n_layer=4;set=embd_pdrop=0;set=attn_pdrop=0;set=resid_pdrop=0;steps=2;seq=16;batch=1;"
      "accum=4;optimizer=momentum;lr=0.01";
  EXPECT_LT(largest_difference(gpt2, 4), 1e-5f);
}

// 2 stages x 2 data-parallel ranks each, the optimizer state sharded over a stage's two ranks
// (and the gradients too; and the weights, gathered a layer at a time for each micro-batch in
// flight): the same weights as one process on the global batch of 8 rows, every copy of a parameter
// (two per stage, and the tied embedding's) equal bitwise.
TEST(Pipeline, TwoStagesOfTwoShardedRanksEachMatchOneProcess) {
  const std::string gpt2 =
      "model=gpt2;set=n_layer=2;set=embd_pdrop=0;set=attn_pdrop=0;set=resid_pdrop=0;steps=2;seq=16;accum=4;"
      "optimizer=momentum;lr=0.01;shard=";
  TempDir alone;  // one process on the global batch, trained once for the three levels
  train(config_of(gpt2 + "none;batch=2"), alone.file("w"));
  for (const char* level : {"optimizer", "gradients", "full"}) {
    SCOPED_TRACE(level);
    EXPECT_LT(largest_difference(gpt2 + level + ";batch=1", 2, 4, "", alone.file("w")), 1e-5f);
  }
}

// 2 stages x 2 data-parallel ranks, gradients (and then weights too) sharded within each stage:
// every rank's peak in every step within 1% of its stage's estimate (estimate --world-size 4
// --pipeline 2 --shard gradients / full). They are usually within a kilobyte; one run in 17 on one
// machine went past 0.1%, unexplained (its figures were not kept), hence the wider bound, still
// inside the 2% the estimate is held to. (At this width full peaks higher than gradients: the
// gathered 50257-row embedding and its collective's buffers outweigh the weights it saves.)
TEST(Pipeline, EveryRankOfTwoStagesOfTwoHasItsEstimatedPeak) {
  for (const std::string level : {"gradients", "full"}) {
    SCOPED_TRACE(level);
    TempDir dir;
    const std::string shape =
        "--device cpu --model gpt2 --set n_layer=4 --set n_embd=256 --set n_head=4 --seq 32 --batch 1 --accum 4 "
        "--pipeline 2 --shard " + level;
    const auto ranks = launch(4, HEADROOM_BINARY,
                              "train " + shape + " --steps 2 --eval-rows 0 --quiet --metrics " + dir.file("m.jsonl"));
    ASSERT_EQ(ranks.code, 0) << ranks.out;
    const auto estimated =
        run_command(fmt::format("{} estimate {} --world-size 4 --json --quiet", HEADROOM_BINARY, shape));
    ASSERT_EQ(estimated.code, 0) << estimated.out;
    const auto stages = nlohmann::json::parse(estimated.out).at("pipeline").at("stages");
    ASSERT_EQ(stages.size(), 2u);
    for (int r = 0; r < 4; ++r) {
      SCOPED_TRACE(fmt::format("rank {}", r));
      const auto predicted = stages[static_cast<size_t>(r / 2)].at("peak_bytes").get<double>();
      for (const auto& step : read_jsonl(r == 0 ? dir.file("m.jsonl") : dir.file(fmt::format("m.rank{}.jsonl", r)))) {
        EXPECT_NEAR(predicted, step.at("peak_bytes").get<double>(), predicted * 1e-2);
      }
    }
  }
}

// Without --pipeline-split the layers are cut where the estimator balances the stages' peaks
// (estimate/pipeline_cut.h), and train cuts them there too. GPT-2's tied head and its float32
// logits over 50257 tokens weigh on the last stage, so the cut gives the first stage more layers
// than the cut balancing parameters: each rank's measured peak within 1% of its stage's estimate,
// and the larger of the two measured below the larger of the parameters' cut's, also measured.
TEST(Pipeline, TheDefaultCutBalancesTheMeasuredPeaks) {
  TempDir dir;
  const std::string shape =
      "--device cpu --model gpt2 --set n_layer=4 --set n_embd=256 --set n_head=4 --seq 256 --batch 1 --accum 4 "
      "--pipeline 2";
  const auto estimated = run_command(fmt::format("{} estimate {} --world-size 2 --json --quiet", HEADROOM_BINARY, shape));
  ASSERT_EQ(estimated.code, 0) << estimated.out;
  const auto pipeline = nlohmann::json::parse(estimated.out).at("pipeline");
  const auto split = pipeline.at("split").get<std::string>();
  const auto by_parameters = pipeline.at("by_parameters").at("split").get<std::string>();
  ASSERT_NE(split, by_parameters);
  auto largest_measured_peak = [&](const std::string& flags, const std::string& name) {
    const auto ranks = launch(2, HEADROOM_BINARY,
                              fmt::format("train {} {} --steps 2 --eval-rows 0 --metrics {}", shape, flags,
                                          dir.file(name + ".jsonl")));
    EXPECT_EQ(ranks.code, 0) << ranks.out;
    double most = 0;
    for (int r = 0; r < 2; ++r) {
      for (const auto& step :
           read_jsonl(r == 0 ? dir.file(name + ".jsonl") : dir.file(fmt::format("{}.rank{}.jsonl", name, r)))) {
        const auto measured = step.at("peak_bytes").get<double>();
        if (flags.empty()) {
          const auto predicted = pipeline.at("stages")[static_cast<size_t>(r)].at("peak_bytes").get<double>();
          EXPECT_NEAR(predicted, measured, predicted * 1e-2) << "rank " << r;
        }
        most = std::max(most, measured);
      }
    }
    return std::pair{most, ranks.out};
  };
  const auto [balanced, said] = largest_measured_peak("", "balanced");
  EXPECT_THAT(said, ::testing::HasSubstr("layers cut --pipeline-split " + split + ", balanced by each stage's "
                                         "estimated peak"));
  const auto [parameters, unused] = largest_measured_peak("--pipeline-split " + by_parameters, "parameters");
  EXPECT_LT(balanced, parameters);
}

// The trainer's own report on 4 stages of GPT-2's vocabulary (tied), without dropout (each stage
// draws its own masks): the final and held-out losses against one process's; each stage's peak, measured by its monitor in every step,
// below the one process's and within 0.1% of its estimate (headroom estimate --pipeline 4).
TEST(Pipeline, EveryStagesPeakIsItsEstimateAndBelowOneProcess) {
  TempDir dir;
  const std::string shape =
      "--device cpu --model gpt2 --set n_layer=4 --set n_embd=256 --set n_head=4 --set embd_pdrop=0 --set "
      "attn_pdrop=0 --set resid_pdrop=0 --seq 32 --batch 1 --accum 4";
  const std::string common = "train " + shape + " --steps 2 --eval-rows 4 --quiet --json --lr 0.001";
  const auto ranks =
      launch(4, HEADROOM_BINARY, common + " --pipeline 4 --metrics " + dir.file("m.jsonl") + " 2>/dev/null");
  ASSERT_EQ(ranks.code, 0) << ranks.out;
  const auto alone = run_command(fmt::format("env OMP_NUM_THREADS=1 {} {}", HEADROOM_BINARY, common));
  ASSERT_EQ(alone.code, 0) << alone.out;
  const auto p = nlohmann::json::parse(ranks.out), a = nlohmann::json::parse(alone.out);
  EXPECT_NEAR(p.at("final_loss").get<double>(), a.at("final_loss").get<double>(), 1e-4);
  EXPECT_NEAR(p.at("eval_loss").get<double>(), a.at("eval_loss").get<double>(), 1e-5);
  const auto estimated = run_command(fmt::format("{} estimate {} --pipeline 4 --json --quiet", HEADROOM_BINARY, shape));
  ASSERT_EQ(estimated.code, 0) << estimated.out;
  const auto stages = nlohmann::json::parse(estimated.out).at("pipeline").at("stages");
  ASSERT_EQ(stages.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE(fmt::format("stage {}", r));
    const auto steps = read_jsonl(r == 0 ? dir.file("m.jsonl") : dir.file(fmt::format("m.rank{}.jsonl", r)));
    ASSERT_EQ(steps.size(), 2u);
    const auto predicted = stages[static_cast<size_t>(r)].at("peak_bytes").get<double>();
    for (const auto& step : steps) {
      const auto measured = step.at("peak_bytes").get<double>();
      EXPECT_LT(measured, a.at("peak_bytes").get<double>());
      EXPECT_NEAR(predicted, measured, measured * 1e-3);
    }
  }
}

// The last of two stages is killed once training runs: the first ends with one line saying so,
// well within its timeout.
TEST(Pipeline, AKilledStageEndsTheOtherWithAnError) {
  const data_parallel_testing::PeerLoss r = data_parallel_testing::lose_peer("--accum 2 --pipeline 2", "KILL");
  ASSERT_GE(r.ms, 0) << r.script_out;
  EXPECT_EQ(r.rc, kExitUsage) << r.err;
  EXPECT_LT(r.ms, 40'000) << "the 10 s timeout (and the time to report) was not kept";
  EXPECT_THAT(r.err, ::testing::HasSubstr("rank 0: lost contact with"));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// Layouts that cannot work are refused before anything trains, in one line each.
TEST(Pipeline, ImpossibleLayoutsAreRefused) {
  const std::string base = "train --device cpu --model tiny --steps 1 --seq 32 --eval-rows 0 --quiet";
  struct Case {
    int ranks;
    std::string flags, says;
  };
  for (const Case& c : std::vector<Case>{
           {2, "--pipeline 3", "--pipeline 3 needs a multiple of 3 ranks"},
           {2, "--pipeline 2 --shard optimizer", "--shard optimizer with --pipeline 2 on 2 ranks"},
           {2, "--pipeline 2 --pipeline-split 0:1,1:3", "ends at layer 3"},
           {2, "--pipeline 2 --save-weights " + TempDir().path(), "--save-weights with --pipeline"},
       }) {
    SCOPED_TRACE(c.flags);
    const auto r = launch(c.ranks, HEADROOM_BINARY, base + " " + c.flags);
    EXPECT_NE(r.code, 0);
    EXPECT_THAT(r.out, ::testing::HasSubstr(c.says));
  }
  const auto more = run_command(fmt::format("{} {} --pipeline 2 2>&1", HEADROOM_BINARY, base));
  EXPECT_EQ(more.code, kExitUsage);
  EXPECT_THAT(more.out, ::testing::HasSubstr("this process is one of 1"));
}

}  // namespace
}  // namespace headroom
