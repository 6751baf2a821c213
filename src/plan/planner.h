// Planner — the fastest way to train a global batch within a memory budget (levers 3, 4, 5, 6, 8).
//
// Enumerates micro-batch × accumulation (the divisors of the global batch, so that the sequences per
// optimizer step stay exactly that),
// precision, checkpointing policy and attention path — and the optimizer only when allowed, since
// it changes the training dynamics — predicts each candidate's peak with the estimator, keeps those
// under the budget less a safety margin, and ranks them by the cost model's step time. Two stages,
// so that the (measured) cost model is calibrated only for the precisions that can fit.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "plan/cost_model.h"

namespace headroom {

// A way to train: the step's settings (config/step_settings.h: micro-batch, accumulation,
// precision, checkpointing, optimizer, attention, shard level; the sequence length and the optimizer
// update's kind are the request's), over `world` ranks, with what it is predicted to cost.
struct Plan : StepSettings {
  // Data-parallel ranks (of each pipeline stage or tensor-parallel share; StepSettings::pipeline and
  // tensor_parallel give those, so the plan's ranks are world x pipeline.stages x tensor_parallel);
  // batch and accum are per data-parallel rank.
  int64_t world = 1;
  int64_t predicted_peak_bytes = 0;  // per rank
  int64_t trainable_params = 0;      // what the update touches (the state levers' cost)
  int64_t offloaded_activation_bytes = 0;  // --offload activations: a micro-batch's, to the host and back
  double predicted_step_seconds = 0;
  // Its terms, as rank_plans costs them: the micro-batches' compute (spread over the stages), the
  // pipeline's bubble (stages idle while it fills and drains), the activations and gradients sent
  // between stages, the data-parallel collectives, the tensor-parallel sums, and the state levers'
  // and offloading's extra.
  struct Terms {
    double compute = 0, bubble = 0, pipeline_transfers = 0, collectives = 0, tensor_collectives = 0, other = 0;
  } terms;
  int64_t ranks() const { return world * pipeline.stages * tensor_parallel; }
  double predicted_step_time_ratio = 1;  // to the best plan's
  nlohmann::json to_json() const;
  // "micro-batch 2 x accum 16, bf16-mixed, checkpointing every:2, flash attention, adamw"
  std::string describe() const;
};

struct PlanRequest {
  RunConfig base;            // model, overrides, seq, data, device, and the precision and optimizer asked for
  int64_t global_batch = 0;  // sequences per optimizer step, over all ranks (world_size_of(base))
  int64_t budget = 0;        // bytes
  double margin = 0.05;      // kept free of the budget, for what the estimator cannot see
  bool allow_optimizer_change = false;  // any optimizer (they change the training dynamics)
  bool allow_adamw8bit = false;         // Adam's or AdamW's update with 8-bit states (--allow adamw8bit)
  bool allow_offload = false;           // the optimizer, the activations or both in host memory (--allow offload)
  // Assumed where not measured (CostModel): the compute rate when steps are not timed, and the link
  // between ranks.
  double assumed_flops = 1e12;
  double link_bytes_per_second = CostModel::kLinkBytesPerSecond;
  // Tensor parallel: the link inside a node its sums cross, and the most ranks it may span (a node's).
  double node_link_bytes_per_second = CostModel::kNodeLinkBytesPerSecond;
  int64_t max_tensor_parallel = 8;
  // 0: every candidate is estimated, and every plan that fits returned. N > 0: at least the N
  // fastest plans that fit (all of them where fewer fit), each estimated exactly, found by
  // estimating the candidates in the order of a bound on their step time that no estimate can
  // lower, until none left can beat the N-th fastest found; the rest are not estimated.
  int64_t best_only = 0;
  // With best_only, a request of at most this many candidates is still estimated exhaustively.
  int64_t exhaustive_up_to = 2000;
  // Threads the candidates' estimates run on. 1 where the caller holds a lock the estimator's
  // LibTorch calls may want on another thread (Python's GIL: the module plans on one).
  int threads = 1;
};

struct PlanResult {
  std::vector<Plan> plans;  // best first
  int64_t considered = 0;      // candidates (layouts and settings) searched
  int64_t estimated = 0;       // of them, estimated exactly (all, unless best_only)
  int64_t smallest_peak = 0;  // over every candidate estimated, fitting or not
  std::string smallest_peak_plan;
  // The host link the offloading plans' copies were costed at (bytes per second each way) and
  // whether it was measured on this machine (or assumed: no calibration, or no plan offloads).
  double host_link_bytes_per_second = CostModel::kHostLinkBytesPerSecond;
  bool host_link_measured = false;
  // Whether step times come from timed steps on this machine (else FLOPs at the request's assumed
  // rate), and the link between ranks they were costed at.
  bool calibrated = false;
  double assumed_flops = 1e12;
  double link_bytes_per_second = CostModel::kLinkBytesPerSecond;
  double node_link_bytes_per_second = CostModel::kNodeLinkBytesPerSecond;
  nlohmann::json to_json() const;  // {"plans": [...], "considered", "calibrated", "host_link": {...}}
};

// Stage 1: every candidate the estimator says fits (unranked; step times not yet set).
PlanResult fitting_plans(const PlanRequest& request);
// Stage 1 when only the fastest matter (request.best_only > 0): the plans found by the bound-first
// search under `cost`, their step times set (rank_plans sorts them).
PlanResult fastest_fitting_plans(const PlanRequest& request, const CostModel& cost);
// How many candidates (layouts and settings) the request's search space holds.
int64_t candidate_count(const PlanRequest& request);
// The precisions among `plans`, for calibrating the cost model.
std::vector<Precision> precisions_of(const PlanResult& plans);
// Stage 2: step times from `cost`, sorted fastest first (fewer micro-batches, then the smaller
// peak, breaking ties), ratios to the fastest.
void rank_plans(PlanResult& plans, const PlanRequest& request, const CostModel& cost);

// Both stages, with the cost model calibrated by timing real steps with `timer` for the precisions
// that fit (null: ranked by FLOPs alone; with request.best_only, the precisions the request allows,
// timed before the search). `known_ratios` are step-time ratios to the base
// precision already measured (the doctor's lever trials): those precisions are not timed again.
// A timing step that runs out of memory leaves the ranking to FLOPs alone. Where a plan that fits
// offloads, `link` (may be null) measures the host link its copies cross. `progress` (may be null)
// hears what is being timed.
PlanResult plan_with_calibration(const PlanRequest& request, const CostModel::StepTimer& timer,
                                 const std::map<Precision, double>& known_ratios = {},
                                 const std::function<void(const std::string&)>& progress = nullptr,
                                 const CostModel::LinkTimer& link = nullptr);

// `config` set to run `plan`, and the plan `config` runs (its peak and time not predicted).
RunConfig with_plan(RunConfig config, const Plan& plan);

// The settings (field keys, config/run_config.h) a plan's command line or run file names even where
// they equal the defaults: the model, the step's shape and levers, the budget. With run_args or
// run_toml's `always`, so that what is written reads as the plan, not as a diff from defaults.
const std::vector<std::string>& plan_keys();
Plan plan_of(const RunConfig& config);

}  // namespace headroom
