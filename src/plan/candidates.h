// The candidates of a plan request: every layout and setting train would run, what one is before
// and after its estimate, and its step time under a cost model. Shared by the planner's two
// searches (plan/planner.cpp, every candidate estimated; plan/plan_search.cpp, bound-first).
#pragma once

#include <cstdint>
#include <vector>

#include "estimate/estimator.h"
#include "plan/planner.h"

namespace headroom {

// What a request searches with: its model, the step it varies, and the bytes a plan may peak at.
struct Search {
  ModelConfig model;
  TrainSpec base;
  double limit = 0;
};
Search search_of(const PlanRequest& request);

// Every layout and setting the request allows that train would run, in a fixed order (a pipeline
// twice: cut evenly, then cut by memory); one line of error where none divides the global batch.
std::vector<TrainSpec> candidates_of(const PlanRequest& request, const ModelConfig& model, const TrainSpec& base);

// For each candidate, the index of its sibling cut evenly (config/pipeline_layout.h's even_cut: the
// same pipeline layout and settings, the fastest cut) where it is a pipeline cut by memory (no split:
// its estimate balances the stages), else SIZE_MAX. Where the sibling fits, the candidate is never
// faster, and the planner lists the sibling alone.
std::vector<size_t> even_siblings(const std::vector<TrainSpec>& candidates);

// Every spec's estimate, on `threads` threads; the first error (in the specs' order) is rethrown.
std::vector<Estimate> estimate_all(const ModelConfig& model, const std::vector<TrainSpec>& specs, int threads);

// The plan a candidate is, unestimated (its peak, cut, trainable and offloaded bytes unknown).
Plan plan_of_spec(const TrainSpec& spec);
// The candidate with what its estimate says; whether it fits under `limit`.
bool estimated_plan(Plan& plan, const Estimate& estimate, double limit);
// The smallest peak seen, for saying what comes nearest when nothing fits.
void note_peak(PlanResult& out, const Plan& plan);

// A plan's step time under `cost` (its terms set); `bound`: before its estimate, a bound that the
// estimate's cut, offloaded bytes and trainable parameters can only raise.
void cost_step(Plan& plan, const PlanRequest& request, const ModelConfig& model, const CostModel& cost,
               bool overlapped, bool bound);

}  // namespace headroom
