#include "plan/candidates.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <set>
#include <thread>

#include "config/lever_support.h"
#include "model/tensor_parallel.h"
#include "plan/levers.h"
#include "util/error.h"

namespace headroom {

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

namespace {

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




// Every layout and setting the request allows that train would run (levers_combine), in a fixed
// order: P pipeline stages (a divisor of the ranks, at most one per layer) of world / P
// data-parallel ranks each; P > 1 where train runs a pipeline (every parameter trained, nothing
// offloaded), and its rows are split over the data-parallel ranks only. Within each, T
// tensor-parallel ranks (a divisor of what is left, up to a node's, that the model's heads, inner
// dimension and vocabulary split over).
std::vector<TrainSpec> candidates_of(const PlanRequest& r, const ModelConfig& model, const TrainSpec& base_spec) {
  const int64_t world = world_size_of(r.base);
  std::vector<TrainSpec> candidates;
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
              spec.reserved_within_budget_only = true;  // what does not fit by allocated bytes is not shown
              if (!levers_combine(spec, model, spec.world)) continue;  // train would refuse it
              // A pipeline twice: cut evenly (the fastest cut), then cut by memory (the estimate's).
              if (stages > 1 && stages < model.num_layers) {
                TrainSpec even = spec;
                even.pipeline.split = even_cut(model.num_layers, stages);
                candidates.push_back(even);
              }
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
  return candidates;
}

std::vector<size_t> even_siblings(const std::vector<TrainSpec>& candidates) {
  std::vector<size_t> out(candidates.size(), SIZE_MAX);
  for (size_t i = 1; i < candidates.size(); ++i) {
    const TrainSpec &balanced = candidates[i], &even = candidates[i - 1];
    if (balanced.pipeline.stages == 1 || !balanced.pipeline.split.empty() || even.pipeline.split.empty()) continue;
    TrainSpec same = even;
    same.pipeline.split.clear();
    if (same == balanced) out[i] = i - 1;
  }
  return out;
}

// The plan a candidate is, unestimated (its peak, cut, trainable and offloaded bytes unknown).
Plan plan_of_spec(const TrainSpec& spec) {
  Plan p;
  p.step() = spec.step();
  p.world = spec.world;
  return p;
}

// The candidate with what its estimate says; whether it fits the request's limit.
bool estimated_plan(Plan& p, const Estimate& e, double limit) {
  p.predicted_peak_bytes = e.peak_bytes;
  p.pipeline.split = e.cut;  // the cut the estimate balanced, which train makes again
  p.trainable_params = e.trainable_params;
  for (const EstimateItem& item : e.host_items) {
    if (item.name == "offloaded activations") p.offloaded_activation_bytes = item.bytes;
  }
  const bool segments_fit = !(e.reserved && e.reserved->oom);
  return static_cast<double>(e.peak_bytes) <= limit && segments_fit;
}

void note_peak(PlanResult& out, const Plan& p) {
  if (out.smallest_peak < 0 || p.predicted_peak_bytes < out.smallest_peak) {
    out.smallest_peak = p.predicted_peak_bytes;
    out.smallest_peak_plan = p.describe();
  }
}

Search search_of(const PlanRequest& r) {
  if (r.global_batch < 1) fail("--global-batch must be positive, got {}", r.global_batch);
  if (r.budget <= 0) fail("the planner needs a memory budget (--memory-budget SIZE)");
  Search s{load_model_config(r.base.model, r.base.overrides), train_spec(r.base),
           static_cast<double>(r.budget) * (1.0 - r.margin)};
  // A caching allocator (cuda, cpu caching) fails on reserved bytes: the step is replayed through
  // its policy under the same limit, and a plan whose segments would not fit is left out.
  if (s.base.caching) s.base.budget = static_cast<int64_t>(s.limit);
  return s;
}

}  // namespace headroom
