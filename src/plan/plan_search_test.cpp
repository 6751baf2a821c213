// The bound-first search (plan/plan_search.cpp) against estimating every candidate, and what it
// assumes of memory held on every candidate of a request.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "estimate/estimator.h"
#include "plan/candidates.h"
#include "plan/planner.h"
#include "util/size.h"

namespace headroom {
namespace {

// A plan request for `model` (a preset) with its depth shrunk by `depth` ("num_hidden_layers=2"),
// 512-token sequences on cuda cards of `budget` bytes, over `world` ranks.
PlanRequest scale_request(const char* model, const std::string& depth, int64_t world, int64_t global, int64_t budget) {
  RunConfig base;
  base.model = model;
  base.eval_rows = 0;
  base.quiet = true;
  base.overrides = {depth};
  base.seq = 512;
  base.device = "cuda";
  base.world_size = world;
  PlanRequest r;
  r.base = base;
  r.global_batch = global;
  r.budget = budget;
  return r;
}

// The bound-first search (best_only) against every candidate estimated: the same fastest plan, the
// same step times for the fastest ten, each of its plans' peaks the estimate of that layout. Real
// widths and vocabularies (tied and untied), depth shrunk; budgets where little and where much fits.
TEST(Planner, TheSearchFindsWhatEstimatingEveryCandidateFinds) {
  struct Case {
    const char* model;
    int64_t world, global;
    double budget_gib;
    int64_t layers = 2, tensor_parallel = 8;  // the most tensor-parallel ranks
  };
  // The last: only pipelines fit (tensor parallel left out), and they lead cut evenly (4 stages of
  // 6 layers: 1, 2, 2, 1), their cuts by memory estimated beside them.
  for (const Case& c : {Case{"gpt2", 4, 16, 2.0}, Case{"qwen3-0.6b", 8, 32, 6.0}, Case{"llama-3.2-1b", 8, 32, 40.0},
                        Case{"qwen3-0.6b", 1, 8, 16.0}, Case{"llama-3.1-8b", 4, 8, 14.0, 6, 1}}) {
    PlanRequest r = scale_request(
        c.model, fmt::format("{}={}", std::string(c.model) == "gpt2" ? "n_layer" : "num_hidden_layers", c.layers),
        c.world, c.global, static_cast<int64_t>(c.budget_gib * (int64_t{1} << 30)));
    r.max_tensor_parallel = c.tensor_parallel;
    const RunConfig& base = r.base;
    r.threads = 2;
    CostModel cost = CostModel::flops_only();
    cost.set_assumed_flops(4e14);
    PlanResult every = fitting_plans(r);
    rank_plans(every, r, cost);
    r.best_only = 10;
    r.exhaustive_up_to = 0;
    PlanResult found = fastest_fitting_plans(r, cost);
    rank_plans(found, r, cost);
    const std::string name = fmt::format("{} on {} ranks, {} GiB", c.model, c.world, c.budget_gib);
    ASSERT_FALSE(every.plans.empty()) << name;
    // A layout cut by memory is listed only where the same cut evenly is not.
    std::set<std::string> listed;
    for (const Plan& p : every.plans) listed.insert(p.describe() + " " + pipeline_split_text(p.pipeline.split));
    int64_t even_cuts = 0;
    for (const Plan& p : every.plans) {
      if (p.pipeline.stages == 1) continue;
      const std::vector<LayerRange> even = even_cut(p.pipeline.split.back().end, p.pipeline.stages);
      if (p.pipeline.split == even) {
        ++even_cuts;
        continue;
      }
      EXPECT_EQ(listed.count(p.describe() + " " + pipeline_split_text(even)), 0u) << name << ": " << p.describe();
    }
    if (c.tensor_parallel == 1) {
      EXPECT_GT(even_cuts, 0) << name;
    }
    ASSERT_GE(found.plans.size(), std::min<size_t>(10, every.plans.size())) << name;
    EXPECT_EQ(found.considered, every.considered) << name;
    EXPECT_LT(found.estimated, every.estimated) << name;
    EXPECT_EQ(found.plans[0].describe(), every.plans[0].describe()) << name;
    EXPECT_EQ(found.plans[0].predicted_peak_bytes, every.plans[0].predicted_peak_bytes) << name;
    const ModelConfig model = load_model_config(base.model, base.overrides);
    for (size_t i = 0; i < std::min<size_t>(10, every.plans.size()); ++i) {
      EXPECT_DOUBLE_EQ(found.plans[i].predicted_step_seconds, every.plans[i].predicted_step_seconds)
          << name << " #" << i;
      TrainSpec spec = train_spec(base);
      spec.step() = found.plans[i].step();
      spec.world = found.plans[i].world;  // its --pipeline-split too: the cut it is run with
      EXPECT_EQ(estimate(model, spec).peak_bytes, found.plans[i].predicted_peak_bytes) << name << " #" << i;
    }
  }
}

// What the bound-first search assumes of memory, held on every candidate of a request: full
// checkpointing, flash attention and bf16-mixed (against fp16-mixed) peak no higher than the
// heavier settings of the same layout and micro-batch (their families settle those), and a larger micro-batch no lower
// where the micro-batches in flight are as many (a family's probes settle the rest; accumulating keeps the first
// micro-batch's gradients through the second, and a pipeline's stage keeps min(accum, P - s) micro-batches). On one
// process exactly; a pipeline's within the margins below. Real widths and vocabularies (tied and untied), depth shrunk,
// pipelines up to 8 stages.
TEST(Planner, MemoryShrinksWithLighterSettingsAndGrowsWithTheMicroBatchAsTheSearchAssumes) {
  struct Case {
    const char* model;
    int64_t layers, world, global;
  };
  for (const Case& c : {Case{"qwen3-0.6b", 2, 4, 16}, Case{"llama-3.2-1b", 8, 8, 16}}) {
    const PlanRequest r =
        scale_request(c.model, fmt::format("num_hidden_layers={}", c.layers), c.world, c.global, int64_t{80} << 30);
    const Search s = search_of(r);
    const std::vector<TrainSpec> candidates = candidates_of(r, s.model, s.base);
    const std::vector<Estimate> estimates = estimate_all(s.model, candidates, 2);
    // a keeps less than b by its settings alone: each that differs lighter (full checkpointing, flash
    // attention but against per-op checkpointing, bf16-mixed against fp16-mixed), the rest the same.
    auto lighter_than = [](const TrainSpec& a, TrainSpec b) {
      bool differs = false;
      if (!(a.checkpointing == b.checkpointing)) {
        if (!(a.checkpointing == CheckpointPolicy::full())) return false;
        b.checkpointing = a.checkpointing;
        differs = true;
      }
      if (a.attention != b.attention) {
        if (a.attention != AttentionPath::flash || b.checkpointing.per_op()) return false;
        b.attention = a.attention;
        differs = true;
      }
      if (a.precision != b.precision) {
        if (a.precision != Precision::bf16_mixed || b.precision != Precision::fp16_mixed) return false;
        b.precision = a.precision;
        differs = true;
      }
      return differs && a == b;
    };
    auto same_but_batch = [](TrainSpec a, const TrainSpec& b) {
      a.batch = b.batch;
      a.accum = b.accum;
      return a == b;
    };
    int64_t compared = 0;
    for (size_t i = 0; i < candidates.size(); ++i) {
      for (size_t j = 0; j < candidates.size(); ++j) {
        const TrainSpec &a = candidates[i], &b = candidates[j];
        const bool lighter = lighter_than(a, b);
        const int64_t replayed = a.pipeline.stages + 1;  // micro-batches a step's replay tells apart
        const bool smaller =
            a.batch < b.batch && std::min(a.accum, replayed) == std::min(b.accum, replayed) && same_but_batch(a, b);
        if (!lighter && !smaller) continue;
        ++compared;
        // plan_search.cpp's others_margin: a pipeline's lighter settings can peak a little higher.
        // A pipeline's micro-batches are cut apart (each its own balanced cut, whose idle peak of
        // building the stage can be the larger): within 5%.
        const double margin = a.pipeline.stages == 1 ? 1.0 : lighter ? 1.25 : 1.05;
        EXPECT_LE(static_cast<double>(estimates[i].peak_bytes), margin * static_cast<double>(estimates[j].peak_bytes))
            << c.model << " on " << c.world << " ranks: " << plan_of_spec(a).describe() << " (pipeline "
            << a.pipeline.stages << ", tensor " << a.tensor_parallel << ") against " << plan_of_spec(b).describe();
      }
    }
    EXPECT_GT(compared, 100) << c.model;
  }
}

}  // namespace
}  // namespace headroom
