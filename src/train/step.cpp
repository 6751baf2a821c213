#include "train/step.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <functional>
#include <limits>

#include "device/autocast_adapter.h"
#include "train/pipeline_step.h"
#include "train/step_ops.h"

namespace headroom {

MicroBatch load_micro_batch(Run& run, const StepShape& s, int64_t m) {
  auto phase = run.monitor->phase(Phase::data);
  const int64_t first = m * s.micro, rows = std::min(s.micro, s.rows - first);
  const Batch b = run.data->train_batch(run.config.seed, s.step, s.rank * s.rows + first, rows);
  // Of the global batch: the ranks' gradients then sum to the whole batch's.
  const double weight = static_cast<double>(rows) / static_cast<double>(s.rows * s.ranks);
  return {b.inputs.to(run.device), b.targets.to(run.device), weight};
}

at::Tensor forward_loss(Run& run, const MicroBatch& b) {
  auto phase = run.monitor->phase(Phase::forward);
  const AutocastScope autocast(run.device.type(), forward_autocast(run.config.precision));
  RouterOutput router;  // a mixture of experts' routing skew, and its load-balancing loss when asked for
  at::Tensor outputs;
  at::Tensor loss = model_loss(*run.model, b.inputs, b.targets, run.forward, run.config.loss, &router, &outputs);
  run.routing_skew = std::max(run.routing_skew, router.skew);
  if (run.config.inject_leak == LeakInjection::keep_outputs) run.leaked_outputs.push_back(outputs.detach());
  outputs.reset();
  if (router.loss.defined()) loss = loss + router.loss;
  if (run.config.inject_leak == LeakInjection::keep_graph) {
    run.leaked_loss = run.leaked_loss.defined() ? run.leaked_loss + loss : loss;
  }
  return loss;
}

void backward_loss(Run& run, const at::Tensor& loss, double weight) {
  auto phase = run.monitor->phase(Phase::backward);
  // Token-weighted: the micro-batches' weighted losses sum to the global batch's mean loss.
  const at::Tensor weighted = loss * weight;
  // A planted keep-graph leak retains each step's graph, as the "fix" for backward complaining
  // about the summed losses' freed graph does.
  (run.scaler ? run.scaler->scale(weighted) : weighted)
      .backward({}, /*retain_graph=*/run.config.inject_leak == LeakInjection::keep_graph);
  if (run.replicas) run.replicas->end_backward();
}

void update(Run& run, double lr, StepOutcome& out) {
  auto phase = run.monitor->phase(Phase::optimizer);
  DataParallel* replicas = run.replicas.get();
  Pipeline* pipe = run.pipeline.get();
  TensorParallelGroup* tensor = run.tensor.get();
  if (replicas) replicas->reduce_gradients();
  // What the optimizer updates: the parameters, or this rank's slices of them (sharded).
  const std::vector<NamedTensor>& updated = replicas ? replicas->optimizer_parameters() : run.parameters();
  if (pipe) pipe->reduce_tied(updated);
  // Whether a rank saw a non-finite gradient: over the data-parallel ranks, then over the stages or
  // the tensor-parallel shares.
  const std::function<bool(bool)> across = [replicas, pipe, tensor](bool found) {
    if (replicas) found = replicas->any(found);
    if (tensor) found = tensor->any(found);
    return pipe ? pipe->any(found) : found;
  };
  if (run.scaler) {
    // fp16: gradients back to their true scale first; a step with an inf or NaN (on any rank) is skipped.
    std::vector<at::Tensor> grads;
    if (replicas) {
      grads = replicas->gradients();
    } else {
      for (const auto& p : run.parameters()) {
        if (p.tensor.grad().defined()) grads.push_back(p.tensor.grad());
      }
    }
    out.skipped = replicas || pipe || tensor ? run.scaler->unscale(grads, across) : run.scaler->unscale(grads);
  }
  if (!out.skipped) {
    // Sharded, each of the stage's (or share's) data-parallel ranks holds a part of its gradients.
    std::function<void(at::Tensor&)> data_sum;
    if (replicas && replicas->sharded()) data_sum = [replicas](at::Tensor& t) { replicas->comm().allreduce(t); };
    if (pipe) {
      // Stages split over tensor-parallel shares: the squares summed over the shares too, each
      // parameter counted once.
      std::function<void(at::Tensor&)> within = data_sum;
      std::function<double(const std::string&)> share;
      if (tensor) {
        within = [data_sum, tensor](at::Tensor& t) {
          if (data_sum) data_sum(t);
          tensor->comm().allreduce(t);
        };
        share = [model = run.model.get()](const std::string& name) { return TensorParallelGroup::share(*model, name); };
      }
      out.grad_norm = pipe->clip_grad_norm(updated, run.config.grad_clip, within, share);
    } else if (tensor) {
      out.grad_norm = tensor->clip_grad_norm(updated, *run.model, run.config.grad_clip, data_sum);
    } else {
      out.grad_norm = replicas ? replicas->clip_grad_norm(run.config.grad_clip)
                               : clip_grad_norm(run.parameters(), run.config.grad_clip);
    }
    out.update_started = true;
    run.optimizer->step(lr);
    if (replicas) replicas->gather_parameters();
  }
  if (run.scaler) run.scaler->update();
}

void clear_gradients(Run& run) {
  auto phase = run.monitor->phase(Phase::zero_grad);
  if (run.replicas) {
    run.replicas->zero_grad();
  } else {
    zero_grad(run.parameters());
  }
}

void rehearse_collectives(Run& run, int64_t step) {
  // Model parallel: an out-of-memory ends the rank (train/oom_guard.h), so there is nothing to replay.
  if (!run.replicas || run.replicas->knows_collective_order() || run.model_parallel()) return;
  // The same graph as a real micro-batch's (the collectives do not depend on its rows), outside the
  // monitor's step; the loss times zero, so nothing is learnt from it.
  run.replicas->begin_micro_batch();
  const Batch b = run.data->train_batch(run.config.seed, step, 0, 1);
  at::Tensor loss;
  {
    const AutocastScope autocast(run.device.type(), forward_autocast(run.config.precision));
    RouterOutput router;
    loss = model_loss(*run.model, b.inputs.to(run.device), b.targets.to(run.device), run.forward, run.config.loss,
                      &router);
    if (router.loss.defined()) loss = loss + router.loss;
  }
  (loss * 0.0).backward();
  run.replicas->end_backward();
  run.replicas->zero_grad();
}

void run_step(Run& run, const StepShape& shape, StepOutcome& out) {
  if (run.pipeline) return run_pipeline_step(run, shape, out);
  seed_step(run.config.seed, shape.step, shape.rank);
  out = StepOutcome{};
  for (int64_t m = 0; m < shape.accum(); ++m) {
    if (run.replicas) run.replicas->begin_micro_batch();
    const MicroBatch batch = load_micro_batch(run, shape, m);
    const at::Tensor loss = forward_loss(run, batch);
    backward_loss(run, loss, batch.weight);
    out.loss += loss.item<double>() * batch.weight;
    if (run.replicas) {
      if (const int code = run.replicas->agree(0); code != 0) throw PeerFailure{code};
    }
  }
  if (run.replicas) {
    out.agreed = true;
    out.loss = run.replicas->sum(out.loss);
  }
  update(run, run.schedule.at(shape.step), out);
  clear_gradients(run);
}

double evaluate(Run& run, int64_t rows) {
  if (run.config.eval_rows == 0) return std::numeric_limits<double>::quiet_NaN();
  if (run.pipeline) return evaluate_pipeline(run, rows);
  const c10::NoGradGuard no_grad;
  const ForwardOptions eval_forward{run.config.attention, /*training=*/false, {}, run.forward.gate};
  double loss_sum = 0;
  int64_t tokens = 0;
  for (const Batch& b : run.data->eval_batches(rows, run.config.eval_rows)) {
    if (!run.replicas) {
      const AutocastScope autocast(run.device.type(), forward_autocast(run.config.precision));
      const at::Tensor loss = model_loss(*run.model, b.inputs.to(run.device), b.targets.to(run.device), eval_forward,
                                         run.config.loss);
      loss_sum += loss.item<double>() * static_cast<double>(b.tokens());
      tokens += b.tokens();
      continue;
    }
    // Ranks: each batch's outcome agreed on, so that all of them stop together; at --shard full a
    // rank that ran out completes the batch's gathers first, which the others are waiting in.
    bool failed = false;
    run.replicas->begin_forward();
    try {
      const AutocastScope autocast(run.device.type(), forward_autocast(run.config.precision));
      const at::Tensor loss = model_loss(*run.model, b.inputs.to(run.device), b.targets.to(run.device), eval_forward,
                                         run.config.loss);
      loss_sum += loss.item<double>() * static_cast<double>(b.tokens());
      tokens += b.tokens();
    } catch (const c10::OutOfMemoryError&) {
      run.replicas->abandon_forward();
      failed = true;
    }
    if (run.replicas->any(failed)) {
      throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                  "out of memory in evaluation on one of the ranks");
    }
  }
  return loss_sum / static_cast<double>(tokens);
}

}  // namespace headroom
