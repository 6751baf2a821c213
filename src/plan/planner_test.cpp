#include "plan/planner.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <utility>

#include "estimate/estimator.h"
#include "memory/oom_report.h"
#include "plan/candidates.h"
#include "train/step_timing.h"
#include "train/trainer.h"
#include "util/size.h"

namespace headroom {
namespace {

RunConfig small_llama() {
  RunConfig c;
  c.model = "tiny";
  c.overrides = {"num_hidden_layers=2", "hidden_size=128", "intermediate_size=256", "num_attention_heads=4",
                 "num_key_value_heads=2"};
  c.seq = 64;
  c.device = "cpu";
  c.eval_rows = 0;
  c.quiet = true;
  return c;
}

int64_t naive_peak(const RunConfig& base, int64_t global) {
  RunConfig naive = base;
  naive.batch = global;
  naive.accum = 1;
  return estimate(load_model_config(naive.model, naive.overrides), train_spec(naive)).peak_bytes;
}

TEST(Planner, TheTopPlanTrainsUnderItsBudget) {
  const RunConfig base = small_llama();
  const int64_t global = 16;
  PlanRequest r;
  r.base = base;
  r.global_batch = global;
  r.budget = naive_peak(base, global) * 6 / 10;  // the naive setting does not fit
  PlanResult plans = fitting_plans(r);
  ASSERT_FALSE(plans.plans.empty());
  rank_plans(plans, r, CostModel::flops_only());
  for (size_t i = 0; i < plans.plans.size(); ++i) {
    const Plan& p = plans.plans[i];
    EXPECT_LE(static_cast<double>(p.predicted_peak_bytes), static_cast<double>(r.budget) * (1 - r.margin));
    EXPECT_EQ(p.optimizer, base.optimizer) << "the optimizer changes only when allowed";
    EXPECT_GE(p.batch * p.accum, global);
    EXPECT_LT(p.batch * (p.accum - 1), global);
    if (i > 0) {
      EXPECT_GE(p.predicted_step_seconds, plans.plans[i - 1].predicted_step_seconds);
    }
  }
  EXPECT_DOUBLE_EQ(plans.plans.front().predicted_step_time_ratio, 1.0);

  RunConfig run = with_plan(base, plans.plans.front());
  run.memory_budget = r.budget;
  run.no_guard = true;  // an OOM would end the run: the plan must fit as predicted
  run.steps = 3;
  const TrainSummary s = train(run).summary;
  EXPECT_EQ(s.steps, 3);
  EXPECT_LE(s.peak_bytes, r.budget);
}

TEST(Planner, OtherOptimizersOnlyWhenAllowedAndNothingFittingIsExplained) {
  PlanRequest r;
  r.base = small_llama();
  r.global_batch = 8;
  r.budget = naive_peak(r.base, 8);
  r.allow_optimizer_change = true;
  const PlanResult all = fitting_plans(r);
  bool other = false;
  for (const Plan& p : all.plans) other = other || p.optimizer != r.base.optimizer;
  EXPECT_TRUE(other);

  r.budget = 1 << 20;  // 1 MiB: not even the weights and optimizer state
  const PlanResult none = fitting_plans(r);
  EXPECT_TRUE(none.plans.empty());
  EXPECT_GT(none.smallest_peak, r.budget);
  EXPECT_NE(none.smallest_peak_plan.find("micro-batch 1"), std::string::npos) << none.smallest_peak_plan;
}

// The state levers at gpt2's real width and vocabulary (depth 2): a budget just under the smallest
// peak of every plan without them is met only by plans that --allow offload or adamw8bit; the top
// one trains under it, with the optimizer's state in host memory. With room to spare, neither is
// chosen: they cost time and change nothing else.
TEST(Planner, OffloadsOrQuantisesTheStateOnlyWhenAllowedAndNeeded) {
  PlanRequest r;
  r.base.model = "gpt2";
  r.base.overrides = {"n_layer=2"};
  r.base.seq = 32;
  r.base.device = "cpu";
  r.base.eval_rows = 0;
  r.base.quiet = true;
  r.global_batch = 4;
  r.margin = 0;
  r.budget = int64_t{1} << 40;
  const int64_t without = fitting_plans(r).smallest_peak;
  r.allow_offload = r.allow_adamw8bit = true;
  PlanResult roomy = fitting_plans(r);
  rank_plans(roomy, r, CostModel::flops_only());
  ASSERT_FALSE(roomy.plans.empty());
  EXPECT_EQ(roomy.plans.front().offload, Offload::none) << roomy.plans.front().describe();
  EXPECT_EQ(roomy.plans.front().optimizer, OptimizerKind::adamw) << roomy.plans.front().describe();

  r.budget = without - 1;
  r.allow_offload = r.allow_adamw8bit = false;
  EXPECT_TRUE(fitting_plans(r).plans.empty());
  r.allow_offload = true;
  PlanResult tight = fitting_plans(r);
  ASSERT_FALSE(tight.plans.empty());
  for (const Plan& p : tight.plans) EXPECT_TRUE(offloads_optimizer(p.offload)) << p.describe();
  rank_plans(tight, r, CostModel::flops_only());
  RunConfig run = with_plan(r.base, tight.plans.front());
  run.memory_budget = r.budget;
  run.no_guard = true;
  run.steps = 2;
  const TrainSummary s = train(run).summary;
  EXPECT_EQ(s.steps, 2);
  EXPECT_LE(s.peak_bytes, r.budget);
  ASSERT_TRUE(s.host_bytes);
  EXPECT_GT(*s.host_bytes, 8 * s.trainable_params) << "two float32 moments a parameter, in host memory";

  r.allow_offload = false;
  r.allow_adamw8bit = true;
  const PlanResult quantised = fitting_plans(r);
  ASSERT_FALSE(quantised.plans.empty());
  for (const Plan& p : quantised.plans) EXPECT_EQ(p.optimizer, OptimizerKind::adamw8bit) << p.describe();
}

// Lever 6 at llama-3.2-1b's real widths, vocabulary and depth (tied embeddings), on 2 ranks: a
// budget between what --shard full and --shard gradients need per rank leaves only full plans; with
// room for both, full (three times the traffic) ranks behind gradients.
TEST(Planner, ShardsTheWeightsOnlyWhenNothingLessFits) {
  RunConfig base;
  base.model = "llama-3.2-1b";
  base.seq = 32;
  base.device = "cpu";
  base.world_size = 2;
  base.batch = 1;
  auto peak_at = [&](ShardLevel level) {
    RunConfig c = base;
    c.shard = level;
    return estimate(load_model_config(c.model, c.overrides), train_spec(c)).peak_bytes;
  };
  const int64_t full = peak_at(ShardLevel::full), gradients = peak_at(ShardLevel::gradients);
  ASSERT_LT(full, gradients) << "16 layers: slicing the weights saves more than gathering the embedding costs";
  PlanRequest r;
  r.base = base;
  r.global_batch = 2;
  r.margin = 0;
  r.budget = (full + gradients) / 2;
  PlanResult tight = fitting_plans(r);
  ASSERT_FALSE(tight.plans.empty());
  int data_parallel = 0;
  for (const Plan& p : tight.plans) {
    // 2 stages of 8 layers each halve the weights too, and so do 2 tensor-parallel shares.
    if (p.pipeline.stages > 1 || p.tensor_parallel > 1) continue;
    ++data_parallel;
    EXPECT_EQ(p.shard, ShardLevel::full) << p.describe();
    EXPECT_EQ(p.world, 2);
    EXPECT_EQ(p.batch * p.accum, 1) << "the global batch of 2 split over the 2 ranks";
  }
  EXPECT_GT(data_parallel, 0);
  r.budget = gradients * 11 / 10;
  PlanResult roomy = fitting_plans(r);
  rank_plans(roomy, r, CostModel::flops_only());
  // At the base's precision (bf16-params, FSDP2's, is a precision of --shard full alone).
  auto first = [&](ShardLevel level) {
    for (size_t i = 0; i < roomy.plans.size(); ++i) {
      if (roomy.plans[i].shard == level && roomy.plans[i].precision != Precision::bf16_params) return i;
    }
    return roomy.plans.size();
  };
  ASSERT_LT(first(ShardLevel::gradients), roomy.plans.size());
  ASSERT_LT(first(ShardLevel::full), roomy.plans.size());
  EXPECT_LT(first(ShardLevel::gradients), first(ShardLevel::full));
}

// On 4 ranks the layouts are 1, 2 and 4 pipeline stages of 4, 2 and 1 data-parallel ranks. Each
// plan's peak is its layout's estimate (every stage replayed); its terms follow 1F1B: the bubble is
// (P - 1)/M of the compute, and 2(M + P - 2) transfers of a micro-batch's activations cross the
// stages' links.
TEST(Planner, PipelineLayoutsArePlannedWithTheirBubbleAndTransfers) {
  RunConfig base;
  base.model = "llama-3.2-1b";
  base.overrides = {"num_hidden_layers=4"};
  base.seq = 32;
  base.device = "cpu";
  base.world_size = 4;
  PlanRequest r;
  r.base = base;
  r.global_batch = 8;
  r.margin = 0;
  r.budget = int64_t{1} << 40;
  PlanResult all = fitting_plans(r);
  rank_plans(all, r, CostModel::flops_only());
  const ModelConfig model = load_model_config(base.model, base.overrides);
  std::set<int64_t> layouts;
  std::set<std::pair<int64_t, int64_t>> fully_sharded;  // (stages, tensor-parallel ranks) with --shard full
  for (const Plan& p : all.plans) {
    SCOPED_TRACE(p.describe());
    layouts.insert(p.pipeline.stages);
    EXPECT_EQ(p.ranks(), 4);
    EXPECT_EQ(p.batch * p.accum * p.world, 8) << "the global batch over the data-parallel ranks";
    const auto stages = static_cast<double>(p.pipeline.stages), m = static_cast<double>(p.accum);
    EXPECT_DOUBLE_EQ(p.terms.bubble, p.terms.compute * (stages - 1) / m);
    // The largest stage of the plan's cut sets the pace: it does its layers' share of the work (the
    // head's FLOPs counted with it), each of T tensor-parallel ranks 1/T of it. The cut is the
    // estimate's (balanced by memory), one range per stage over the 4 layers.
    int64_t most = model.num_layers;
    if (p.pipeline.stages > 1) {
      ASSERT_EQ(static_cast<int64_t>(p.pipeline.split.size()), p.pipeline.stages);
      EXPECT_EQ(p.pipeline.split.back().end, model.num_layers);
      most = 0;
      for (const LayerRange& range : p.pipeline.split) most = std::max(most, range.end - range.first);
    }
    const double work = CostModel::flops_only().step_seconds(model, p.batch, 8 / p.world, base.seq, p.precision,
                                                             p.checkpointing, p.attention, p.loss.chunked);
    EXPECT_DOUBLE_EQ(p.terms.compute, work * static_cast<double>(most) / static_cast<double>(model.num_layers) /
                                          static_cast<double>(p.tensor_parallel));
    // Activations cross in the dtype the model computes with (bf16-params: bf16).
    const int64_t elem = p.precision == Precision::bf16_params ? 2 : 4;
    const double transfer = static_cast<double>(p.batch * base.seq * model.hidden_size * elem) / 5e9 + 50e-6;
    EXPECT_NEAR(p.terms.pipeline_transfers, p.pipeline.stages == 1 ? 0.0 : 2 * (m + stages - 2) * transfer, 1e-12);
    if (p.shard == ShardLevel::full) fully_sharded.insert({p.pipeline.stages, p.tensor_parallel});
  }
  EXPECT_EQ(layouts, (std::set<int64_t>{1, 2, 4}));
  // ZeRO-3 inside a stage or a share, where 2 data-parallel ranks are left to shard over.
  EXPECT_EQ(fully_sharded, (std::set<std::pair<int64_t, int64_t>>{{1, 1}, {2, 1}, {1, 2}}));
  // Tensor parallel: Llama-3.2-1B's 32 heads, 8 key/value heads, 8192 inner and 128256 vocabulary
  // split over 2 and 4 (with 2 stages, over 2). Its sums per micro-batch: 4 per
  // layer and 2 more, each a ring allreduce of [B, T, hidden] (float32 here), 2(T-1)/T of it over an
  // assumed 150 GB/s, plus 50 µs each and three more for the loss; with 2 stages, the largest stage's
  // share of them (its layers' part of the 4).
  std::set<int64_t> widths;
  for (const Plan& p : all.plans) {
    SCOPED_TRACE(p.describe());
    widths.insert(p.tensor_parallel);
    if (p.tensor_parallel == 1) {
      EXPECT_EQ(p.terms.tensor_collectives, 0.0);
      continue;
    }
    EXPECT_LE(p.pipeline.stages * p.tensor_parallel, 4);
    const auto t = static_cast<double>(p.tensor_parallel);
    const double bytes =
        static_cast<double>(p.batch * base.seq * model.hidden_size) * (p.precision == Precision::fp32 ? 4 : 2);
    const double sums = (4 * 4 + 2) * (2 * (t - 1) / t * bytes / 1.5e11 + 50e-6) + 3 * 50e-6;
    int64_t most = model.num_layers;
    if (p.pipeline.stages > 1) {
      most = 0;
      for (const LayerRange& range : p.pipeline.split) most = std::max(most, range.end - range.first);
    }
    EXPECT_NEAR(p.terms.tensor_collectives,
                static_cast<double>(p.accum) * sums * static_cast<double>(most) / static_cast<double>(model.num_layers),
                1e-12);
  }
  EXPECT_EQ(widths, (std::set<int64_t>{1, 2, 4}));
  // A pipeline plan's peak is the largest stage's, every stage replayed.
  for (const Plan& p : all.plans) {
    if (p.pipeline.stages == 1 || p.accum < 2) continue;
    RunConfig c = with_plan(base, p);
    TrainSpec spec = train_spec(c);
    EXPECT_EQ(spec.world, p.world);
    EXPECT_EQ(estimate(model, spec).peak_bytes, p.predicted_peak_bytes) << p.describe();
    break;
  }
}

// The levers of the runs launched at scale are planned among the others: FSDP2's bf16 parameters
// (alone, or at --shard full over 2 ranks, never at another shard level: train refuses it) and
// per-op checkpointing, each plan's peak its own estimate.
TEST(Planner, RanksFsdpPrecisionAndPerOpCheckpointingAmongTheLevers) {
  RunConfig base = small_llama();
  base.world_size = 2;
  PlanRequest r;
  r.base = base;
  r.global_batch = 8;
  r.margin = 0;
  r.budget = int64_t{1} << 40;
  const PlanResult all = fitting_plans(r);
  const ModelConfig model = load_model_config(base.model, base.overrides);
  std::set<std::string> seen;
  for (const Plan& p : all.plans) {
    if (p.precision == Precision::bf16_params) {
      seen.insert("bf16-params at " + std::string(shard_level_name(p.shard)));
      EXPECT_TRUE(p.shard == ShardLevel::full || p.world == 1) << p.describe();
    }
    if (p.checkpointing.per_op()) seen.insert("ops");
    if (p.precision != Precision::bf16_params && !p.checkpointing.per_op()) continue;
    TrainSpec spec = train_spec(base);
    spec.step() = p.step();
    spec.world = p.world;
    EXPECT_EQ(estimate(model, spec).peak_bytes, p.predicted_peak_bytes) << p.describe();
  }
  EXPECT_TRUE(seen.count("ops"));
  EXPECT_TRUE(seen.count("bf16-params at full"));
}

// The planner's shortcut (only the first of the middle stages alike in layers) finds the same worst
// stage as replaying all: Llama-3.2-1B's 16 layers in 2, 4, 8 and 16 stages.
TEST(Planner, TheStageShortcutFindsTheWorstStage) {
  const ModelConfig model = load_model_config("llama-3.2-1b", {});
  for (int64_t stages : {2, 4, 8, 16}) {
    for (int64_t accum : {1, 3, 32}) {
      SCOPED_TRACE(fmt::format("{} stages, {} micro-batches", stages, accum));
      TrainSpec spec;
      spec.seq = 64;
      spec.batch = 2;
      spec.accum = accum;
      spec.pipeline.stages = stages;
      const Estimate every = estimate(model, spec);
      spec.every_stage = false;
      const Estimate some = estimate(model, spec);
      EXPECT_EQ(every.stages.size(), static_cast<size_t>(stages));
      EXPECT_LE(some.stages.size(), every.stages.size());
      EXPECT_EQ(some.peak_bytes, every.peak_bytes);
      EXPECT_EQ(some.stage, every.stage);
    }
  }
}

TEST(CostModel, CountsRecomputeAndTheFixedCostOfEachMicroBatch) {
  const RunConfig base = small_llama();
  const ModelConfig m = load_model_config(base.model, base.overrides);
  const auto none = parse_checkpoint_policy("none"), selective = parse_checkpoint_policy("selective");
  const auto every2 = parse_checkpoint_policy("every:2"), full = parse_checkpoint_policy("full");
  const double f_none = micro_batch_flops(m, 4, 64, none, AttentionPath::flash);
  EXPECT_LT(f_none, micro_batch_flops(m, 4, 64, selective, AttentionPath::flash));
  EXPECT_LT(micro_batch_flops(m, 4, 64, selective, AttentionPath::flash),
            micro_batch_flops(m, 4, 64, full, AttentionPath::flash));
  EXPECT_LE(micro_batch_flops(m, 4, 64, every2, AttentionPath::flash),
            micro_batch_flops(m, 4, 64, full, AttentionPath::flash));
  // Full recompute: one more forward, a third more than forward + backward (less the head's share).
  EXPECT_NEAR(micro_batch_flops(m, 4, 64, full, AttentionPath::flash) / f_none, 4.0 / 3.0, 0.1);
  EXPECT_LT(f_none, micro_batch_flops(m, 4, 64, none, AttentionPath::math));

  const std::optional<CostModel> calibrated =
      CostModel::calibrate(base, {Precision::fp32}, 4,
                           [&](Precision p, int64_t rows, int timed) { return time_train_step(base, p, rows, timed); });
  ASSERT_TRUE(calibrated && calibrated->calibrated());
  const CostModel& cost = *calibrated;
  const StepTimeFit fit = cost.fits().at(Precision::fp32);
  EXPECT_GT(fit.seconds_per_flop, 0);
  EXPECT_GE(fit.seconds_per_micro_batch, 0);
  // The same work in 8 micro-batches costs at least as much as in one.
  EXPECT_GE(cost.step_seconds(m, 1, 8, 64, Precision::fp32, none, AttentionPath::flash),
            cost.step_seconds(m, 8, 8, 64, Precision::fp32, none, AttentionPath::flash));
}

// The offloads' copies cross the host link: assumed until measured, and measured (once) only when a
// plan that fits offloads. Seconds by hand: both ways, for each micro-batch.
TEST(CostModel, OffloadsAreCostedOverTheHostLinkMeasuredWhenAPlanOffloads) {
  CostModel cost = CostModel::flops_only();
  EXPECT_FALSE(cost.host_link_measured());
  EXPECT_DOUBLE_EQ(cost.activation_offload_seconds(1'000'000'000, 3), 2.0 * 1e9 * 3 / 2e10);
  cost.set_host_link(1e9);
  EXPECT_TRUE(cost.host_link_measured());
  EXPECT_DOUBLE_EQ(cost.activation_offload_seconds(1'000'000'000, 3), 6.0);
  // On cuda, 1 s each way a micro-batch over 4 layers: the copy down hides behind the layers'
  // forward, the prefetches of the lower three layers behind backward (twice the forward), the top
  // layer's quarter of the copy back not at all.
  EXPECT_DOUBLE_EQ(cost.activation_offload_seconds(1'000'000'000, 3, 0.5, 4), 3 * (0.5 + 0.25 + 0.0));
  EXPECT_DOUBLE_EQ(cost.activation_offload_seconds(1'000'000'000, 3, 0.2, 4), 3 * (0.8 + 0.25 + 0.75 * 0.6));
  EXPECT_DOUBLE_EQ(cost.activation_offload_seconds(1'000'000'000, 3, 5.0, 4), 3 * 0.25);
  // gpt2's two layers over 2 x 32 tokens, by hand: 2 · 7,077,888 matmul weights a layer · 64 tokens,
  // and flash attention's 4 · 64 · 32 · 768 / 2 a layer, at the uncalibrated 1e-12 s a FLOP.
  const ModelConfig gpt2 = load_model_config("gpt2", {"n_layer=2"});
  EXPECT_NEAR(CostModel::flops_only().layers_forward_seconds(gpt2, 2, 32, Precision::fp32, AttentionPath::flash),
              (2.0 * 2 * 7'077'888 * 64 + 2.0 * 4 * 64 * 32 * 768 / 2) * 1e-12, 1e-18);
  // An offloaded AdamW over a million float32 parameters: 4 MB of gradients down and 4 MB of
  // weights up, and 2 ns a value on the host.
  EXPECT_NEAR(cost.state_lever_seconds(1'000'000, Precision::fp32, OptimizerKind::adamw, Offload::optimizer),
              0.008 + 0.002, 1e-12);
  EXPECT_THROW(cost.set_host_link(0), std::invalid_argument);

  PlanRequest r;
  r.base.model = "gpt2";
  r.base.overrides = {"n_layer=2"};
  r.base.seq = 32;
  r.base.device = "cpu";
  r.global_batch = 4;
  r.margin = 0;
  r.budget = int64_t{1} << 40;
  int calls = 0;
  const CostModel::LinkTimer link = [&calls]() -> std::optional<double> {
    ++calls;
    return 5e9;
  };
  const PlanResult roomy = plan_with_calibration(r, nullptr, {}, nullptr, link);
  EXPECT_EQ(calls, 0) << "no plan offloads";
  EXPECT_FALSE(roomy.host_link_measured);
  EXPECT_EQ(roomy.to_json()["host_link"]["bytes_per_second"].get<double>(), CostModel::kHostLinkBytesPerSecond);
  r.budget = fitting_plans(r).smallest_peak - 1;
  r.allow_offload = true;
  const PlanResult tight = plan_with_calibration(r, nullptr, {}, nullptr, link);
  ASSERT_FALSE(tight.plans.empty());
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(tight.host_link_measured);
  EXPECT_EQ(tight.to_json()["host_link"]["bytes_per_second"].get<double>(), 5e9);

  // This machine's own: some positive speed (what it is depends on the machine).
  const std::optional<double> measured = host_link_bytes_per_second("cpu");
  ASSERT_TRUE(measured.has_value());
  EXPECT_GT(*measured, 0);
  EXPECT_TRUE(std::isfinite(*measured));
}

}  // namespace
}  // namespace headroom
