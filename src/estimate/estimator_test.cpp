// The estimator against ground truth: published parameter counts, the trainer's own model, and
// what the budget allocator and the memory monitor measure in real training steps over a grid of
// real models (testing/estimate_grid.h).
#include "estimate/estimator.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "config/run_config.h"
#include "memory/budget_allocator.h"
#include "model/causal_lm.h"
#include "testing/estimate_grid.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"
#include "testing/test_models.h"
#include "train/trainer.h"

namespace headroom {
namespace {

TrainSpec spec_for(const RunConfig& cfg) { return train_spec(cfg); }

TEST(Estimator, ParameterCountsEqualThePublishedOnes) {
  const std::vector<std::pair<std::string, int64_t>> published = {{"gpt2", 124'439'808},
                                                                  {"llama-3.2-1b", 1'235'814'400},
                                                                  {"qwen2.5-0.5b", 494'032'768},
                                                                  {"pythia-160m", 162'322'944},
                                                                  // by hand: 49152·576 + 30·3,540,096 + 576
                                                                  {"smollm-135m", 134'515'008}};
  for (const auto& [preset, params] : published) {
    TrainSpec spec;
    spec.batch = 1;
    spec.seq = 16;
    const Estimate e = estimate(load_model_config(preset), spec);
    EXPECT_EQ(e.params, params) << preset;
    // The weights it holds are those parameters at 4 bytes each (a tied head counted once).
    EXPECT_EQ(e.category(sim::Category::weights), params * 4) << preset;
  }
}

TEST(Estimator, ShrunkModelsHoldExactlyTheTrainersParameters) {
  for (const auto& m : testing::shrunk_models()) {
    const ModelConfig c = m.load();
    const CausalLM model(c, at::TensorOptions().dtype(at::kFloat), 1);
    int64_t built = 0;  // counted from the trainer's model, storage once per tensor
    for (const auto& p : model.parameters()) built += p.tensor.numel();
    TrainSpec spec;
    spec.batch = 1;
    spec.seq = 8;
    spec.precision = Precision::bf16;
    const Estimate e = estimate(c, spec);
    EXPECT_EQ(e.params, model.num_parameters()) << m.label;
    EXPECT_EQ(e.category(sim::Category::weights), built * 2) << m.label;
  }
}

TEST(Estimator, A70BConfigIsEstimatedWithoutAllocatingItsWeights) {
  BudgetAllocator& a = BudgetAllocator::install();
  const int64_t before = a.live_bytes();
  a.reset_peak();
  TrainSpec spec;
  spec.batch = 1;
  spec.seq = 4096;
  spec.precision = Precision::bf16_mixed;
  spec.checkpointing.kind = CheckpointPolicy::Kind::full;
  spec.cuda = true;
  const Estimate e = estimate(load_model_config("llama-3.1-70b"), spec);
  EXPECT_EQ(e.params, 70'553'706'496);
  // Weights (4 B), gradients (4 B) and adamw's moments (8 B): at least 16 bytes per parameter.
  EXPECT_GE(e.peak_bytes, 16 * e.params);
  EXPECT_LT(a.peak_bytes() - before, 64 << 20) << "the estimate must not allocate the model";
}

TEST(Estimator, ReportsTheLogitsAndLossBuffersSeparately) {
  TrainSpec spec;
  spec.batch = 4;
  spec.seq = 64;
  const ModelConfig c = load_model_config("tiny", {"vocab_size=8192"});  // the loss dominates
  const Estimate e = estimate(c, spec);
  const int64_t tokens = spec.batch * spec.seq;
  // At the start of backward: the float32 log-softmax, its incoming gradient and the logits'
  // gradient, B·T·vocab × 4 each (logits themselves are gone by then).
  EXPECT_EQ(e.peak_phase, Phase::backward);
  EXPECT_EQ(e.category(sim::Category::loss), tokens * c.vocab_size * 4);
  EXPECT_GE(e.category(sim::Category::temporaries), 2 * tokens * c.vocab_size * 4);
  int64_t total = 0;
  for (const auto& item : e.items) total += item.bytes;
  EXPECT_EQ(total, e.peak_bytes) << "the items explain every byte";
  const nlohmann::json j = e.to_json();
  EXPECT_EQ(j["peak_bytes"].get<int64_t>(), e.peak_bytes);
  EXPECT_EQ(j["model"]["params"].get<int64_t>(), e.params);
  for (const char* key : {"weights", "gradients", "optimizer", "activations", "logits", "loss", "temporaries"}) {
    EXPECT_TRUE(j["breakdown"].contains(key)) << key;
  }
}

TEST(Estimator, OnCudaEveryBlockIsRoundedTo512Bytes) {
  const ModelConfig c = load_model_config("tiny");
  TrainSpec spec;
  spec.batch = 2;
  spec.seq = 33;  // odd sizes: most activations are not multiples of 512 bytes
  const Estimate cpu = estimate(c, spec);
  spec.cuda = true;
  const Estimate cuda = estimate(c, spec);
  EXPECT_GT(cuda.category(sim::Category::allocator), 0);
  EXPECT_EQ(cpu.category(sim::Category::allocator), 0);
  // The same tensors, each rounded up: no less than on cpu (where the corpus is also counted).
  EXPECT_GE(cuda.peak_bytes, cpu.peak_bytes - cpu.category(sim::Category::other));
}

// The estimator cannot drift from the trainer silently: for each configuration of the test's subset of the grid
// (testing::accuracy_subset; the whole grid runs in bench_estimate_accuracy), one
// real training run of two steps (the second runs with the optimizer state of the first) on the cpu
// caching allocator, measured by it and the memory monitor, against the estimate:
//   - weights, gradients and optimizer state as the update finds them: exactly equal;
//   - the step's peak, and each phase's, within a tolerance for what kernels allocate by machine;
//   - the peak reserved bytes (the estimator's allocation sequence replayed through the same
//     policy) within 3%.
class EstimatorAccuracy : public ::testing::TestWithParam<testing::GridFamily> {};

TEST_P(EstimatorAccuracy, PredictsWhatTheTrainerMeasures) {
  const auto grid = testing::accuracy_subset(GetParam());
  ASSERT_GE(grid.size(), 1u);
  double sum = 0, worst = 0, worst_phase = 0, worst_reserved = 0;
  std::string worst_config, worst_phase_config, worst_reserved_config;
  for (RunConfig cfg : grid) {
    cfg.allocator = AllocatorKind::caching;
    cfg.allocator_conf = "backend:native";  // the policy's defaults, whatever the environment says
    cfg.steps = 2;
    cfg.eval_rows = 0;
    cfg.quiet = true;
    const TrainResult run = train(cfg);
    ASSERT_EQ(run.steps.size(), 2u) << testing::describe(cfg);
    const StepRecord& step = run.steps[1];
    const Estimate e = estimate(load_model_config(cfg.model, cfg.overrides), spec_for(cfg));

    // Model states, exactly: the optimizer phase's breakdown at its peak holds all three.
    const PhaseMemory& update = step.memory.phases[static_cast<size_t>(Phase::optimizer) - 1];
    auto at_update = [&](sim::Category c) { return e.at_update[static_cast<size_t>(c)]; };
    EXPECT_EQ(update.at_peak.weights, at_update(sim::Category::weights)) << testing::describe(cfg);
    EXPECT_EQ(update.at_peak.gradients, at_update(sim::Category::gradients)) << testing::describe(cfg);
    EXPECT_EQ(update.at_peak.optimizer, at_update(sim::Category::optimizer)) << testing::describe(cfg);
    // Offloaded: the host pool's peak in the step, exactly (the state, the host copies, and the
    // update's host temporaries); nothing of the optimizer's on the device.
    // Offloaded activations: the layers' saved storages in the host pool, exactly.
    if (cfg.offload != Offload::none) {
      ASSERT_TRUE(step.host_peak_bytes) << testing::describe(cfg);
      EXPECT_EQ(*step.host_peak_bytes, e.host_bytes) << testing::describe(cfg);
      if (offloads_optimizer(cfg.offload)) {
        EXPECT_EQ(update.at_peak.optimizer, 0) << testing::describe(cfg);
      }
    } else {
      EXPECT_EQ(e.host_bytes, 0) << testing::describe(cfg);
    }

    // The step's peak: the estimate's own may be earlier, while the model is built (a float32
    // initialisation copy of a large frozen embedding can outweigh a LoRA step), which the trainer
    // does not count as a step's.
    const int64_t measured = step.peak_bytes;
    const int64_t step_peak = e.step_peak();
    const double error = static_cast<double>(step_peak - measured) / static_cast<double>(measured);
    ASSERT_TRUE(step.peak_reserved_bytes && e.reserved) << testing::describe(cfg);
    const int64_t reserved = *step.peak_reserved_bytes;
    const double reserved_error =
        static_cast<double>(e.reserved->peak_reserved - reserved) / static_cast<double>(reserved);
    std::printf("  %+7.3f%%  measured %11lld  estimated %11lld  reserved %+7.3f%% (%11lld vs %11lld)  %s\n",
                100 * error, static_cast<long long>(measured), static_cast<long long>(step_peak),
                100 * reserved_error, static_cast<long long>(reserved), static_cast<long long>(e.reserved->peak_reserved),
                testing::describe(cfg).c_str());
    if (std::abs(reserved_error) > worst_reserved) {
      worst_reserved = std::abs(reserved_error);
      worst_reserved_config = testing::describe(cfg);
    }
    sum += std::abs(error);
    if (std::abs(error) > worst) {
      worst = std::abs(error);
      worst_config = testing::describe(cfg);
    }
    for (Phase p : kStepPhases) {
      const PhaseMemory& m = step.memory.phases[static_cast<size_t>(p) - 1];
      ASSERT_TRUE(m.seen) << phase_name(p);
      const int64_t predicted = e.phase_peaks[static_cast<size_t>(p)];
      const double phase_error = std::abs(static_cast<double>(predicted - m.peak)) / static_cast<double>(m.peak);
      if (phase_error > worst_phase) {
        worst_phase = phase_error;
        worst_phase_config = fmt::format("{} in {}: measured {}, estimated {}", testing::describe(cfg), phase_name(p),
                                         m.peak, predicted);
      }
    }
  }
  const double mean = sum / static_cast<double>(grid.size());
  std::printf("  mean |error| %.4f%%, worst %.4f%% (%s); worst phase %.4f%% (%s); worst reserved %.4f%% (%s)\n",
              100 * mean, 100 * worst, worst_config.c_str(), 100 * worst_phase, worst_phase_config.c_str(),
              100 * worst_reserved, worst_reserved_config.c_str());
  EXPECT_LE(mean, 0.0025);
  EXPECT_LE(worst, 0.01) << worst_config;
  EXPECT_LE(worst_phase, 0.02) << worst_phase_config;
  EXPECT_LE(worst_reserved, 0.03) << worst_reserved_config;
}

// Fine-tuning Llama-3.2-1B's widths and vocabulary (2 layers, 1 x 32 tokens), its embedding tied and
// untied: LoRA on q and v (AdamW), the embedding frozen (SGD: AdamW's state for an untied head alone
// is 4.2 GB), and LoRA on an NF4 base (AdamW). What estimate
// prints as the peak is the measured step's within 1%: the model's construction (a float32 1.05 GB
// embedding among frozen weights) never peaks above the step it comes before, as it once did when
// each parameter was drawn in a float32 copy beside the model (46% above a LoRA step).
TEST(Estimator, FineTuningATiedOrUntiedModelPeaksWhereTheStepDoes) {
  for (const char* tied : {"true", "false"}) {
    for (const auto& [finetune, base] : std::vector<std::pair<std::string, std::string>>{
             {"lora:r=16,targets=q,v", "dense"}, {"freeze:embed_tokens.weight", "dense"}, {"lora:r=16", "nf4"}}) {
      RunConfig cfg;
      cfg.model = "llama-3.2-1b";
      cfg.overrides = {"num_hidden_layers=2", std::string("tie_word_embeddings=") + tied};
      cfg.batch = 1;
      cfg.seq = 32;
      cfg.finetune = parse_finetune(finetune);
      cfg.base_weights = parse_base_weights(base);
      cfg.optimizer = cfg.finetune.is_lora() ? OptimizerKind::adamw : OptimizerKind::sgd;
      cfg.steps = 2;
      cfg.eval_rows = 0;
      cfg.quiet = true;
      const TrainResult run = train(cfg);
      ASSERT_EQ(run.steps.size(), 2u);
      const int64_t measured = run.steps.back().peak_bytes;
      const Estimate e = estimate(load_model_config(cfg.model, cfg.overrides), spec_for(cfg));
      EXPECT_NEAR(static_cast<double>(e.peak_bytes), static_cast<double>(measured), 0.01 * static_cast<double>(measured))
          << "tied " << tied << ", " << finetune << ", base " << base;
      std::printf("  tied %-5s %-28s base %-5s: measured step %lld, estimate %lld (%+.3f%%)\n", tied, finetune.c_str(),
                  base.c_str(), static_cast<long long>(measured), static_cast<long long>(e.peak_bytes),
                  100.0 * static_cast<double>(e.peak_bytes - measured) / static_cast<double>(measured));
    }
  }
}

// --offload activations over five of pythia-160m's layers (real width and vocabulary, an untied
// head), LoRA-trained with a chunked loss so that backward's peak is in the layers, not in the head
// or at the gradients' end: backward holds
// the layer it is in and the one below it, prefetched, each freed once its last node has run. The
// estimate is the measured step's peak and each phase's within 0.01%, the host pool's peak exactly,
// with and without checkpointing; and backward holds less than without the lever, as measured.
TEST(Estimator, OffloadedActivationsComeBackTwoLayersAtATime) {
  for (const char* checkpointing : {"none", "selective", "full"}) {
    RunConfig cfg;
    cfg.model = "pythia-160m";
    cfg.overrides = {"num_hidden_layers=5"};
    cfg.batch = 2;
    cfg.seq = 64;
    cfg.finetune = parse_finetune("lora:r=8");
    cfg.loss = parse_loss("chunked:16");
    cfg.optimizer = parse_optimizer("sgd");
    cfg.checkpointing = parse_checkpoint_policy(checkpointing);
    cfg.allocator = AllocatorKind::caching;
    cfg.allocator_conf = "backend:native";
    cfg.steps = 2;
    cfg.eval_rows = 0;
    cfg.quiet = true;
    const TrainResult kept = train(cfg);
    cfg.offload = Offload::activations;
    const TrainResult moved = train(cfg);
    ASSERT_EQ(moved.steps.size(), 2u);
    const StepRecord& step = moved.steps[1];
    const Estimate e = estimate(load_model_config(cfg.model, cfg.overrides), spec_for(cfg));
    auto near = [](int64_t estimated, int64_t measured) {
      return std::abs(static_cast<double>(estimated - measured)) <= 1e-4 * static_cast<double>(measured);
    };
    EXPECT_PRED2(near, e.step_peak(), step.peak_bytes) << checkpointing;
    for (Phase p : kStepPhases) {
      EXPECT_PRED2(near, e.phase_peaks[static_cast<size_t>(p)], step.memory.phases[static_cast<size_t>(p) - 1].peak)
          << checkpointing << " in " << phase_name(p);
    }
    ASSERT_TRUE(step.host_peak_bytes);
    EXPECT_EQ(*step.host_peak_bytes, e.host_bytes) << checkpointing;
    const auto backward = static_cast<size_t>(Phase::backward) - 1;
    EXPECT_LT(step.memory.phases[backward].peak, kept.steps[1].memory.phases[backward].peak) << checkpointing;
  }
}

// A mixture of experts routes as its router decides: trained on the bundled corpus (so that the
// router has learnt something), qwen3-30b-a3b's layer at its real width and vocabulary, with 16 of
// its experts, 2 per token, is measured in its third step and estimated under each assumption: the
// balanced one within the accuracy test's 1%, the skew the run measured as close, and the worst
// case the capacity allows (two experts take every token) never below what was measured.
TEST(EstimatorExperts, RealRoutingIsPredictedBalancedAndBoundedByTheWorstCase) {
  RunConfig cfg;
  cfg.model = "qwen3-30b-a3b";
  cfg.overrides = {"num_hidden_layers=1", "num_experts=16", "num_experts_per_tok=2"};
  cfg.batch = 4;
  cfg.seq = 128;
  cfg.precision = Precision::bf16;
  cfg.optimizer = OptimizerKind::sgd;
  cfg.steps = 3;
  cfg.eval_rows = 0;
  cfg.quiet = true;
  cfg.device = "cpu";
  const TrainResult run = train(cfg);
  ASSERT_EQ(run.steps.size(), 3u);
  const StepRecord& step = run.steps[2];
  ASSERT_TRUE(step.routing_skew.has_value());
  EXPECT_GT(*step.routing_skew, 1.0);  // real routing is not exactly balanced
  const int64_t measured = step.peak_bytes;
  const ModelConfig model = load_model_config(cfg.model, cfg.overrides);
  auto estimated = [&](const std::string& routing) {
    TrainSpec spec = spec_for(cfg);
    spec.routing = parse_moe_routing(routing);
    const Estimate e = estimate(model, spec);
    EXPECT_TRUE(e.experts.has_value());
    EXPECT_EQ(e.experts->routing, spec.routing.name());
    return e.peak_bytes;
  };
  const int64_t balanced = estimated("balanced"), worst = estimated("worst");
  const int64_t skewed = estimated(fmt::format("{}", *step.routing_skew));
  auto error = [&](int64_t e) { return static_cast<double>(e - measured) / static_cast<double>(measured); };
  std::printf("  measured %lld (routing skew %.2f); balanced %+.3f%%, measured skew %+.3f%%, worst %+.3f%%\n",
              static_cast<long long>(measured), *step.routing_skew, 100 * error(balanced), 100 * error(skewed),
              100 * error(worst));
  EXPECT_LE(std::abs(error(balanced)), 0.01);
  EXPECT_LE(std::abs(error(skewed)), 0.01);
  EXPECT_GE(worst, balanced);
  EXPECT_GE(error(worst), -0.001);
}

TEST(EstimatorExperts, NamesTheExpertsApartAndSaysTheyAreReplicatedUnderDataParallel) {
  TrainSpec spec;
  spec.batch = 1;
  spec.seq = 16;
  spec.precision = Precision::bf16;
  spec.world = 4;
  const ModelConfig c = load_model_config("mixtral-8x7b", {"num_hidden_layers=2"});
  const Estimate e = estimate(c, spec);
  ASSERT_TRUE(e.experts.has_value());
  // By hand: 2 layers × 8 experts × 3 matrices of 4096 × 14336, 2 bytes each.
  const int64_t expert_params = int64_t{2} * 8 * 3 * 4096 * 14336;
  EXPECT_EQ(e.experts->weights, expert_params * 2);
  EXPECT_EQ(e.experts->gradients, expert_params * 2);  // the peak is in backward's end or the update
  EXPECT_EQ(e.category(sim::Category::weights), count_parameters(c) * 2);
  EXPECT_EQ(e.experts->sparse_layers, 2);
  EXPECT_EQ(e.experts->world, 4);
  EXPECT_NE(e.table().find("replicated on each of 4 ranks"), std::string::npos) << e.table();
  EXPECT_EQ(e.to_json()["experts"]["routing"], "balanced");
}

INSTANTIATE_TEST_SUITE_P(Families, EstimatorAccuracy, ::testing::ValuesIn(testing::grid_families()),
                         [](const ::testing::TestParamInfo<testing::GridFamily>& info) { return info.param.label; });

}  // namespace
}  // namespace headroom

namespace headroom {
namespace {

// --pipeline 2 on Llama-3.2-1B's width and vocabulary (tied), 4 layers: the embedding on stage 0 and
// the head's copy of it on stage 1, two layers each (the cut whose largest stage is smallest); the
// stages' weights add up to the whole model's plus that copy. Under 1F1B the first stage holds more
// micro-batches' activations as the accumulation grows, and the last one at a time.
TEST(EstimatorPipeline, StagesSplitTheWeightsAndTheFirstHoldsMoreMicroBatches) {
  const ModelConfig c = load_model_config("llama-3.2-1b", {"num_hidden_layers=4"});
  TrainSpec spec;
  spec.seq = 64;
  spec.batch = 1;
  spec.pipeline.stages = 2;
  auto stage = [&](int64_t k, int64_t accum) {
    TrainSpec s = spec;
    s.stage = k;
    s.accum = accum;
    return estimate(c, s);
  };
  const int64_t tied = c.vocab_size * c.hidden_size * 4;
  TrainSpec one = spec;
  one.pipeline.stages = 1;
  const Estimate whole = estimate(c, one);
  const Estimate s0 = stage(0, 4), s1 = stage(1, 4);
  EXPECT_EQ(s0.category(sim::Category::weights) + s1.category(sim::Category::weights),
            whole.category(sim::Category::weights) + tied);
  EXPECT_EQ(s0.params + s1.params, count_parameters(c) + c.vocab_size * c.hidden_size);
  const Estimate both = estimate(c, [&] {
    TrainSpec s = spec;
    s.accum = 4;
    return s;
  }());
  ASSERT_EQ(both.stages.size(), 2u);
  EXPECT_EQ(both.stages[0].first_layer, 0);
  EXPECT_EQ(both.stages[0].end_layer, 2);
  EXPECT_EQ(both.stages[1].end_layer, 4);
  EXPECT_EQ(both.stages[0].in_flight, 2);
  EXPECT_EQ(both.stages[1].in_flight, 1);
  EXPECT_EQ(both.stages[0].peak_bytes, s0.step_peak());
  EXPECT_EQ(both.peak_bytes, std::max(s0, s1, [](const Estimate& a, const Estimate& b) {
                               return a.step_peak() < b.step_peak();
                             }).peak_bytes);
  EXPECT_GT(stage(0, 4).category(sim::Category::activations), stage(0, 1).category(sim::Category::activations));
  EXPECT_EQ(stage(1, 4).category(sim::Category::activations), stage(1, 2).category(sim::Category::activations));
  // Every stage below the whole model on one rank.
  EXPECT_LT(s0.step_peak(), whole.step_peak());
  EXPECT_LT(s1.step_peak(), whole.step_peak());
}

}  // namespace
}  // namespace headroom
