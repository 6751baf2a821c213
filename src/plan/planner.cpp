#include "plan/planner.h"

#include "config/lever_support.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <set>
#include <thread>

#include "dist/pipeline_schedule.h"
#include "estimate/estimator.h"
#include "model/tensor_parallel.h"
#include "plan/levers.h"
#include "util/error.h"

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
          {"calibrated", calibrated},
          {"assumed_flops_per_second", calibrated ? nlohmann::json() : nlohmann::json(assumed_flops)},
          {"link_bytes_per_second", link_bytes_per_second},
          {"node_link_bytes_per_second", node_link_bytes_per_second},
          {"host_link", {{"bytes_per_second", host_link_bytes_per_second}, {"measured", host_link_measured}}}};
}

namespace {

// Every spec's estimate, on `threads` threads; the first error (in the specs' order) is rethrown.
std::vector<Estimate> estimate_all(const ModelConfig& model, const std::vector<TrainSpec>& specs, int threads) {
  std::vector<Estimate> out(specs.size());
  std::vector<std::exception_ptr> errors(specs.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < specs.size(); i = next++) {
      try {
        out[i] = estimate(model, specs[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < std::min(static_cast<size_t>(std::clamp(threads, 1, 256)), specs.size()); ++t) {
    pool.emplace_back(work);
  }
  work();
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return out;
}

// The pipeline depths to consider on `world` ranks: its divisors up to the layers (1 among them).
std::vector<int64_t> layout_stages(int64_t world, int64_t layers) {
  std::vector<int64_t> out;
  for (int64_t p = 1; p <= std::min(world, layers); ++p) {
    if (world % p == 0) out.push_back(p);
  }
  return out;
}

// The tensor-parallel widths to consider on `ranks` ranks: its divisors up to `most` that `model`
// splits over (model/tensor_parallel.h), 1 among them.
std::vector<int64_t> tensor_parallel_widths(const ModelConfig& model, int64_t ranks, int64_t most) {
  std::vector<int64_t> out{1};
  for (int64_t t = 2; t <= std::min(ranks, most); ++t) {
    if (ranks % t != 0) continue;
    try {
      check_tensor_parallel(model, t);
      out.push_back(t);
    } catch (const Error&) {
    }
  }
  return out;
}

std::vector<int64_t> micro_batches(int64_t global) {
  std::set<int64_t> out;
  for (int64_t d = 1; d * d <= global; ++d) {
    if (global % d == 0) {
      out.insert(d);
      out.insert(global / d);
    }
  }
  return {out.begin(), out.end()};
}

}  // namespace

PlanResult fitting_plans(const PlanRequest& r) {
  if (r.global_batch < 1) fail("--global-batch must be positive, got {}", r.global_batch);
  if (r.budget <= 0) fail("the planner needs a memory budget (--memory-budget SIZE)");
  const int64_t world = world_size_of(r.base);
  const ModelConfig model = load_model_config(r.base.model, r.base.overrides);
  TrainSpec base_spec = train_spec(r.base);
  const double limit = static_cast<double>(r.budget) * (1.0 - r.margin);
  // A caching allocator (cuda, cpu caching) fails on reserved bytes: the step is replayed through
  // its policy under the same limit, and a plan whose segments would not fit is left out.
  if (base_spec.caching) base_spec.budget = static_cast<int64_t>(limit);
  PlanResult out;
  out.smallest_peak = -1;
  std::vector<TrainSpec> candidates;
  // The layouts: P pipeline stages (a divisor of the ranks, at most one per layer) of world / P
  // data-parallel ranks each; P > 1 where train runs a pipeline (every parameter trained, nothing
  // offloaded), and its rows are split over the data-parallel ranks only.
  // Within each, T tensor-parallel ranks (a divisor of what is left, up to a node's, that the model's
  // heads, inner dimension and vocabulary split over).
  for (int64_t stages : layout_stages(world, model.num_layers)) {
  if (stages > 1 && (!r.base.finetune.full() || r.base.offload != Offload::none)) continue;
  for (int64_t tensor : tensor_parallel_widths(model, world / stages, r.max_tensor_parallel)) {
  if (tensor > 1 && (!r.base.finetune.full() || r.base.offload != Offload::none)) continue;
  const int64_t data_ranks = world / stages / tensor;
  if (r.global_batch % data_ranks != 0) continue;
  const int64_t per_rank = r.global_batch / data_ranks;
  for (int64_t micro : micro_batches(per_rank)) {
    for (Precision precision : precision_settings(r.base.precision)) {
      for (const CheckpointPolicy& checkpointing : checkpoint_settings(model)) {
        for (AttentionPath attention : attention_settings()) {
          for (OptimizerKind optimizer :
               optimizer_settings(r.base.optimizer, r.allow_optimizer_change, r.allow_adamw8bit)) {
            for (Offload offload : offload_settings(r.base.offload, r.allow_offload, world)) {
            if (!trainable_where(optimizer, offload, base_spec.cuda)) continue;
            if (tensor > 1 && (optimizer == OptimizerKind::adafactor || optimizer == OptimizerKind::adamw8bit)) continue;
            for (ShardLevel shard : shard_settings(data_ranks)) {
            for (const LossSetting& loss : loss_settings(r.base.loss, shard, data_ranks)) {
              if (tensor > 1 && loss.chunked) continue;  // train refuses it
              TrainSpec spec = base_spec;
              spec.loss = loss;
              spec.batch = micro;
              spec.accum = (per_rank + micro - 1) / micro;
              spec.precision = precision;
              spec.checkpointing = checkpointing;
              spec.attention = attention;
              spec.optimizer = optimizer;
              spec.offload = offload;
              spec.world = data_ranks;
              spec.shard = shard;
              spec.pipeline = PipelineLayout{stages, {}};
              spec.tensor_parallel = tensor;
              spec.stage = -1;
              spec.every_stage = false;
              if (!levers_combine(spec, model, spec.world)) continue;  // train would refuse it
              candidates.push_back(spec);
            }
            }
            }
          }
        }
      }
    }
  }
  }
  }
  if (candidates.empty()) {
    fail("--global-batch {} is not a multiple of --world-size {} (nor of its data-parallel ranks in any pipeline "
         "layout): each data-parallel rank trains an equal share; accepted: {} or {}",
         r.global_batch, world, r.global_batch / world * world > 0 ? r.global_batch / world * world : world,
         (r.global_batch / world + 1) * world);
  }
  // Estimated side by side, each on its own (a replay shares nothing), and kept in the order above.
  // A pipeline's layers are cut as train cuts them by default, balancing the stages' estimated
  // peaks (estimate/pipeline_cut.h), which costs a layout's estimate 1.7x to 3x the parameters' cut.
  const std::vector<Estimate> estimates = estimate_all(model, candidates, r.threads);
  for (size_t i = 0; i < candidates.size(); ++i) {
    const TrainSpec& spec = candidates[i];
    const Estimate& e = estimates[i];
    const int64_t peak = e.peak_bytes;
    const bool segments_fit = !(e.reserved && e.reserved->oom);
    ++out.considered;
    Plan p;
    p.step() = spec.step();
    p.world = spec.world;
    p.predicted_peak_bytes = peak;
    p.pipeline.split = e.cut;  // the cut the estimate balanced, which train makes again
    p.trainable_params = e.trainable_params;
    for (const EstimateItem& item : e.host_items) {
      if (item.name == "offloaded activations") p.offloaded_activation_bytes = item.bytes;
    }
    if (out.smallest_peak < 0 || peak < out.smallest_peak) {
      out.smallest_peak = peak;
      out.smallest_peak_plan = p.describe();
    }
    if (static_cast<double>(peak) <= limit && segments_fit) out.plans.push_back(p);
  }
  return out;
}

std::vector<Precision> precisions_of(const PlanResult& plans) {
  std::set<Precision> seen;
  for (const Plan& p : plans.plans) seen.insert(p.precision);
  return {seen.begin(), seen.end()};
}

void rank_plans(PlanResult& plans, const PlanRequest& r, const CostModel& cost) {
  const ModelConfig model = load_model_config(r.base.model, r.base.overrides);
  // On cuda activation offload copies beside the compute stream (model/activation_offload.h).
  const bool overlapped = train_spec(r.base).cuda;
  for (Plan& p : plans.plans) {
    const auto stages = static_cast<double>(p.pipeline.stages), m = static_cast<double>(p.accum);
    // A data-parallel rank's micro-batches, each stage doing its layers' share of every one, the
    // stage with the most layers setting the pace; under 1F1B the last micro-batch leaves its stage
    // P - 1 stage-times after the first could have: the bubble.
    const double work = cost.step_seconds(model, p.batch, r.global_batch / p.world, r.base.seq, p.precision,
                                          p.checkpointing, p.attention, p.loss.chunked);
    double share = 1;
    if (p.pipeline.stages > 1) {
      int64_t most = 0;
      for (const LayerRange& range : pipeline_stages(model, p.pipeline)) most = std::max(most, range.end - range.first);
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
  PlanResult result = fitting_plans(r);
  if (result.plans.empty()) return result;
  CostModel cost = CostModel::flops_only();
  if (timer) {
    // Time the precisions that fit and are not known yet; the base precision too when others are
    // known, since their ratios are relative to it.
    const Precision own = r.base.precision;
    std::vector<Precision> untimed;
    if (!known_ratios.empty()) untimed.push_back(own);
    for (Precision p : precisions_of(result)) {
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
      std::any_of(result.plans.begin(), result.plans.end(), [](const Plan& p) { return p.offload != Offload::none; });
  if (link && offloading) {
    if (progress) progress("measuring the host link the offloaded bytes cross (64 MiB copies each way)");
    if (const std::optional<double> bytes_per_second = link()) cost.set_host_link(*bytes_per_second);
  }
  cost.set_assumed_flops(r.assumed_flops);
  cost.set_link(r.link_bytes_per_second);
  cost.set_node_link(r.node_link_bytes_per_second);
  result.calibrated = cost.calibrated();
  result.node_link_bytes_per_second = r.node_link_bytes_per_second;
  result.assumed_flops = r.assumed_flops;
  result.link_bytes_per_second = r.link_bytes_per_second;
  result.host_link_bytes_per_second = cost.host_link();
  result.host_link_measured = cost.host_link_measured();
  rank_plans(result, r, cost);
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
