#include "plan/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "dist/pipeline_schedule.h"
#include "estimate/estimator.h"
#include "plan/candidates.h"
#include "plan/levers.h"

namespace headroom {

nlohmann::json Plan::to_json() const {
  return {{"batch", batch},
          {"accum", accum},
          {"precision", precision_name(precision)},
          {"checkpointing", checkpointing.name()},
          {"optimizer", optimizer_name(optimizer)},
          {"attention", attention_path_name(attention)},
          {"offload", offload_name(offload)},
          {"loss", loss.name()},
          {"shard", shard_level_name(shard)},
          {"world_size", ranks()},
          {"pipeline", pipeline.stages},
          {"pipeline_split", pipeline_split_text(pipeline.split)},
          {"tensor_parallel", tensor_parallel},
          {"data_parallel", world},
          {"predicted_step_terms",
           {{"compute_seconds", terms.compute},
            {"bubble_seconds", terms.bubble},
            {"pipeline_transfer_seconds", terms.pipeline_transfers},
            {"collective_seconds", terms.collectives},
            {"tensor_parallel_seconds", terms.tensor_collectives},
            {"other_seconds", terms.other}}},
          {"predicted_peak_bytes", predicted_peak_bytes},
          {"predicted_step_seconds", predicted_step_seconds},
          {"predicted_step_time_ratio", predicted_step_time_ratio}};
}

std::string Plan::describe() const {
  std::string offloaded;
  if (offloads_optimizer(offload)) offloaded += " offloaded to host memory";
  if (offloads_activations(offload)) offloaded += ", activations offloaded to host memory";
  return fmt::format("micro-batch {} x accum {}, {}, checkpointing {}, {} attention, {}{}{}{}{}", batch, accum,
                     precision_name(precision), checkpointing.name(), attention_path_name(attention),
                     optimizer_name(optimizer), offloaded, loss.chunked ? ", chunked loss" : "",
                     tensor_parallel > 1 ? fmt::format(", each layer split over {} tensor-parallel ranks", tensor_parallel)
                                         : "",
                     pipeline.stages > 1
                         ? fmt::format(", {} pipeline stages x {} rank{} each{}", pipeline.stages, world,
                                       world == 1 ? "" : "s",
                                       world > 1 ? fmt::format(" with --shard {}", shard_level_name(shard)) : "")
                     : world > 1 ? fmt::format(", on each of {} ranks with --shard {}", world, shard_level_name(shard))
                                 : "");
}

nlohmann::json PlanResult::to_json() const {
  nlohmann::json list = nlohmann::json::array();
  for (const Plan& p : plans) list.push_back(p.to_json());
  return {{"plans", list},
          {"considered", considered},
          {"estimated", estimated},
          {"calibrated", calibrated},
          {"assumed_flops_per_second", calibrated ? nlohmann::json() : nlohmann::json(assumed_flops)},
          {"link_bytes_per_second", link_bytes_per_second},
          {"node_link_bytes_per_second", node_link_bytes_per_second},
          {"host_link", {{"bytes_per_second", host_link_bytes_per_second}, {"measured", host_link_measured}}}};
}

int64_t candidate_count(const PlanRequest& r) {
  const Search s = search_of(r);
  return static_cast<int64_t>(candidates_of(r, s.model, s.base).size());
}

PlanResult fitting_plans(const PlanRequest& r) {
  const Search s = search_of(r);
  PlanResult out;
  out.smallest_peak = -1;
  const std::vector<TrainSpec> candidates = candidates_of(r, s.model, s.base);
  // Estimated side by side, each on its own (a replay shares nothing), and kept in the order above.
  // A pipeline's layers are cut as train cuts them by default, balancing the stages' estimated
  // peaks (estimate/pipeline_cut.h), which costs a layout's estimate 1.7x to 3x the parameters' cut.
  const std::vector<Estimate> estimates = estimate_all(s.model, candidates, r.threads);
  out.considered = out.estimated = static_cast<int64_t>(candidates.size());
  const std::vector<size_t> even = even_siblings(candidates);
  std::vector<char> fits(candidates.size(), 0);
  for (size_t i = 0; i < candidates.size(); ++i) {
    Plan p = plan_of_spec(candidates[i]);
    fits[i] = estimated_plan(p, estimates[i], s.limit);
    note_peak(out, p);
    // A layout cut by memory is never faster than cut evenly: listed only where that does not fit.
    if (fits[i] && !(even[i] != SIZE_MAX && fits[even[i]])) out.plans.push_back(p);
  }
  return out;
}

std::vector<Precision> precisions_of(const PlanResult& plans) {
  std::set<Precision> seen;
  for (const Plan& p : plans.plans) seen.insert(p.precision);
  return {seen.begin(), seen.end()};
}

void cost_step(Plan& p, const PlanRequest& r, const ModelConfig& model, const CostModel& cost, bool overlapped,
               bool bound) {
  const auto stages = static_cast<double>(p.pipeline.stages), m = static_cast<double>(p.accum);
  // A data-parallel rank's micro-batches, each stage doing its layers' share of every one, the
  // stage with the most layers setting the pace; under 1F1B the last micro-batch leaves its stage
  // P - 1 stage-times after the first could have: the bubble.
  const double work = cost.step_seconds(model, p.batch, r.global_batch / p.world, r.base.seq, p.precision,
                                        p.checkpointing, p.attention, p.loss.chunked);
  double share = 1;
  if (p.pipeline.stages > 1) {
    // A bound: no stage of any cut has fewer than the layers shared as evenly as they go. A layout
    // cut by memory (no split) is listed only where its even cut (even_cut) does not fit, and so is
    // cut otherwise: where the stages divide the layers, with a stage of one layer more.
    const int64_t layers = model.num_layers, p_stages = p.pipeline.stages;
    int64_t most = (layers + p_stages - 1) / p_stages;
    if (bound && p.pipeline.split.empty() && layers % p_stages == 0 && p_stages < layers) ++most;
    if (!bound) {
      most = 0;
      for (const LayerRange& range : pipeline_stages(model, p.pipeline)) most = std::max(most, range.end - range.first);
    }
    share = static_cast<double>(most) / static_cast<double>(model.num_layers);
  }
  // Tensor parallel: each rank does 1/T of every matmul (the norms and the rest, replicated, are
  // small beside them), and holds 1/T of the parameters its data-parallel ranks reduce.
  const auto tensor = static_cast<double>(p.tensor_parallel);
  p.terms.compute = work * share / tensor;
  p.terms.bubble = p.terms.compute * (stages - 1) / m;
  p.terms.pipeline_transfers = cost.pipeline_transfer_seconds(model, p.batch, r.base.seq, p.precision,
                                                              p.pipeline.stages, p.accum);
  // Each stage's data-parallel ranks reduce (and gather) its parameters, about 1/P of them.
  p.terms.collectives = cost.communication_seconds(model, p.precision, p.world, p.shard, p.accum) / stages / tensor;
  // The tensor-parallel sums of the layers a rank holds: paced, as compute is, by the largest stage.
  p.terms.tensor_collectives =
      cost.tensor_parallel_seconds(model, p.batch, r.base.seq, p.precision, p.tensor_parallel, p.accum) * share;
  p.terms.other = cost.activation_offload_seconds(p.offloaded_activation_bytes, p.accum,
                                                  overlapped ? cost.layers_forward_seconds(model, p.batch, r.base.seq,
                                                                                           p.precision, p.attention)
                                                             : 0.0,
                                                  model.num_layers) +
                  cost.state_lever_seconds(p.trainable_params, p.precision, p.optimizer, p.offload) / stages;
  p.predicted_step_seconds = p.terms.compute + p.terms.bubble + p.terms.pipeline_transfers + p.terms.collectives +
                             p.terms.tensor_collectives + p.terms.other;
}

void rank_plans(PlanResult& plans, const PlanRequest& r, const CostModel& cost) {
  const ModelConfig model = load_model_config(r.base.model, r.base.overrides);
  // On cuda activation offload copies beside the compute stream (model/activation_offload.h).
  const bool overlapped = train_spec(r.base).cuda;
  for (Plan& p : plans.plans) cost_step(p, r, model, cost, overlapped, /*bound=*/false);
  // Ties (an uncalibrated model sees only FLOPs; float sums differ in the last bits): fewer, larger
  // micro-batches, then the smaller peak.
  std::stable_sort(plans.plans.begin(), plans.plans.end(), [](const Plan& a, const Plan& b) {
    const double scale = std::max(a.predicted_step_seconds, b.predicted_step_seconds);
    if (std::abs(a.predicted_step_seconds - b.predicted_step_seconds) > 1e-9 * scale) {
      return a.predicted_step_seconds < b.predicted_step_seconds;
    }
    if (a.accum != b.accum) return a.accum < b.accum;
    return a.predicted_peak_bytes < b.predicted_peak_bytes;
  });
  if (plans.plans.empty()) return;
  const double best = plans.plans.front().predicted_step_seconds;
  for (Plan& p : plans.plans) p.predicted_step_time_ratio = best > 0 ? p.predicted_step_seconds / best : 1.0;
}

PlanResult plan_with_calibration(const PlanRequest& r, const CostModel::StepTimer& timer,
                                 const std::map<Precision, double>& known_ratios,
                                 const std::function<void(const std::string&)>& progress,
                                 const CostModel::LinkTimer& link) {
  // Exhaustive: every candidate estimated, the cost model calibrated for the precisions that fit.
  // A search (best_only): the cost model calibrated first, for every precision the request allows,
  // since it orders the search.
  const bool search = r.best_only > 0 && candidate_count(r) > r.exhaustive_up_to;
  PlanResult result;
  if (!search) {
    result = fitting_plans(r);
    if (result.plans.empty()) return result;
  }
  const std::vector<Precision> precisions = search ? precision_settings(r.base.precision) : precisions_of(result);
  CostModel cost = CostModel::flops_only();
  if (timer) {
    // Time the precisions that fit and are not known yet; the base precision too when others are
    // known, since their ratios are relative to it.
    const Precision own = r.base.precision;
    std::vector<Precision> untimed;
    if (!known_ratios.empty()) untimed.push_back(own);
    for (Precision p : precisions) {
      if (known_ratios.count(p) == 0 && (known_ratios.empty() || p != own)) untimed.push_back(p);
    }
    if (progress) {
      progress(fmt::format("calibrating step time on this machine ({} precision{}, 2 micro-batch sizes)",
                           untimed.size(), untimed.size() == 1 ? "" : "s"));
    }
    // A line per timed run: on a cpu each can take a minute.
    int started = 0;
    const int runs = untimed.empty() ? 0 : static_cast<int>(untimed.size()) + 1;
    const CostModel::StepTimer reporting = [&](Precision p, int64_t rows, int steps) {
      if (progress) {
        progress(fmt::format("  timing {} step{} at {}, micro-batch {} ({} of {})", steps, steps == 1 ? "" : "s",
                             precision_name(p), rows, ++started, runs));
      }
      return timer(p, rows, steps);
    };
    if (auto calibrated = CostModel::calibrate(r.base, untimed, std::min<int64_t>(4, r.global_batch), reporting)) {
      cost = known_ratios.empty() ? *calibrated : CostModel::with_ratios(*calibrated, own, known_ratios);
    } else if (progress) {
      progress("calibration ran out of memory; ranking by FLOPs alone");
    }
  }
  const bool offloading =
      search ? r.allow_offload || r.base.offload != Offload::none
             : std::any_of(result.plans.begin(), result.plans.end(),
                           [](const Plan& p) { return p.offload != Offload::none; });
  if (link && offloading) {
    if (progress) progress("measuring the host link the offloaded bytes cross (64 MiB copies each way)");
    if (const std::optional<double> bytes_per_second = link()) cost.set_host_link(*bytes_per_second);
  }
  cost.set_assumed_flops(r.assumed_flops);
  cost.set_link(r.link_bytes_per_second);
  cost.set_node_link(r.node_link_bytes_per_second);
  if (search) {
    result = fastest_fitting_plans(r, cost);
    if (result.plans.empty()) return result;
  }
  result.calibrated = cost.calibrated();
  result.node_link_bytes_per_second = r.node_link_bytes_per_second;
  result.assumed_flops = r.assumed_flops;
  result.link_bytes_per_second = r.link_bytes_per_second;
  result.host_link_bytes_per_second = cost.host_link();
  result.host_link_measured = cost.host_link_measured();
  rank_plans(result, r, cost);
  // A search found the fastest best_only exactly; those after them need not be the next fastest.
  if (search && static_cast<int64_t>(result.plans.size()) > r.best_only) {
    result.plans.erase(result.plans.begin() + r.best_only, result.plans.end());
  }
  return result;
}

Plan plan_of(const RunConfig& c) {
  Plan p;
  p.step() = c.step();
  p.world = std::max<int64_t>(1, world_size_of(c) / (c.pipeline.stages * c.tensor_parallel));
  return p;
}

const std::vector<std::string>& plan_keys() {
  static const std::vector<std::string> keys = {"model",         "seq",       "batch",     "accum",        "precision",
                                                "checkpointing", "attention", "optimizer", "memory-budget"};
  return keys;
}

RunConfig with_plan(RunConfig c, const Plan& p) {
  c.step() = p.step();
  c.plan_auto = false;
  return c;
}

}  // namespace headroom
