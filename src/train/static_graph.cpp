#include "train/static_graph.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <chrono>
#include <vector>

#include "device/autocast_adapter.h"
#include "device/cuda_adapter.h"
#include "device/cuda_graph.h"
#include "device/device.h"
#include "train/run.h"
#include "train/step.h"
#include "train/step_ops.h"
#include "util/error.h"
#include "util/stats.h"

namespace headroom {

namespace {

using Clock = std::chrono::steady_clock;

// What the trial's pieces share: the run and its config, the eager steps' count, the card, and each
// micro-batch's weight in the step's loss.
struct Trial {
  Run& run;
  const RunConfig& cfg;
  int64_t steps;
  int index;
  double weight;  // equal micro-batches: token-weighted mean
};

// The captured work: forward, loss and backward of one micro-batch, as the trainer's phases do them
// (without the monitor's bookkeeping, which reads allocator statistics).
at::Tensor micro_batch_loss(const Trial& t, const at::Tensor& inputs, const at::Tensor& targets) {
  const AutocastScope autocast(t.run.device.type(), forward_autocast(t.cfg.precision));
  return model_loss(*t.run.model, inputs, targets, t.run.forward, t.cfg.loss);
}

void micro_batch_backward(const Trial& t, const at::Tensor& loss) {
  const at::Tensor weighted = loss * t.weight;
  (t.run.scaler ? t.run.scaler->scale(weighted) : weighted).backward();
}

// The seconds `body` takes on the card, its queued work included.
template <class Body>
double timed(int index, Body&& body) {
  cuda_synchronize(index);
  const auto t0 = Clock::now();
  body();
  cuda_synchronize(index);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Eager: the trainer's own step, `steps` times, from an empty cache.
void measure_eager(const Trial& t, StaticGraphTrial& r) {
  const StepShape first_shape{0, t.cfg.batch * t.cfg.accum, t.cfg.batch};
  cuda_empty_cache();
  cuda_reset_peak_stats(t.index);
  std::vector<double> eager;
  for (int64_t step = 0; step < t.steps; ++step) {
    eager.push_back(timed(t.index, [&] {
      StepShape shape = first_shape;
      shape.step = step;
      StepOutcome out;
      run_step(t.run, shape, out);
    }));
  }
  const CudaMemoryStats eager_stats = cuda_memory_stats(t.index);
  r.eager_step_seconds = median_after_warmup(eager);
  r.eager_peak_reserved = eager_stats.peak_reserved_bytes;
  r.eager_peak_allocated = eager_stats.peak_allocated_bytes;
}

// The loss of the first micro-batch of the next step, eagerly, on the weights the graph starts from.
double eager_first_loss(const Trial& t, const at::Tensor& inputs, const at::Tensor& targets) {
  const c10::NoGradGuard no_grad;
  seed_step(t.cfg.seed, t.steps);
  return micro_batch_loss(t, inputs, targets).item<double>();
}

// Gradients exist before the capture, so that the captured backward adds into them.
void allocate_gradients(const Trial& t) {
  cuda_empty_cache();
  cuda_reset_peak_stats(t.index);
  for (const auto& p : t.run.parameters())
    if (p.tensor.requires_grad()) p.tensor.mutable_grad() = at::zeros_like(p.tensor);
}

// Captures the micro-batch's forward, loss and backward into `graph`, its loss into `static_loss`;
// false, with the reason in r.failure and the gradients dropped, when it cannot.
bool capture_step(const Trial& t, CudaGraph& graph, const at::Tensor& inputs, const at::Tensor& targets,
                  at::Tensor& static_loss, StaticGraphTrial& r) {
  try {
    if (t.cfg.checkpointing.kind != CheckpointPolicy::Kind::none) {
      fail(
          "activation checkpointing saves and restores the CUDA random-number state for its recompute, which a "
          "capture cannot read");
    }
    if (t.run.model_config.moe) {
      fail("a mixture of experts sizes each expert's work by its routing, read back to the host every step, which "
           "a capture cannot contain");
    }
    graph.capture(t.index, [&] {
      static_loss = micro_batch_loss(t, inputs, targets);
      micro_batch_backward(t, static_loss);
    });
  } catch (const Error& e) {
    r.failure = e.what();
    zero_grad(t.run.parameters());
    return false;
  }
  return true;
}

// One graphed step: each micro-batch's tokens copied into the captured inputs and replayed, then
// the eager update.
void replay_step(const Trial& t, CudaGraph& graph, const at::Tensor& inputs, const at::Tensor& targets,
                 const at::Tensor& static_loss, int64_t step, StaticGraphTrial& r) {
  for (const auto& p : t.run.parameters())
    if (p.tensor.grad().defined()) p.tensor.grad().zero_();  // in place: the graph writes into these
  seed_step(t.cfg.seed, step);
  for (int64_t m = 0; m < t.cfg.accum; ++m) {
    if (step > t.steps || m > 0) {
      const Batch b = t.run.data->train_batch(t.cfg.seed, step, m * t.cfg.batch, t.cfg.batch);
      inputs.copy_(b.inputs);
      targets.copy_(b.targets);
    }
    graph.replay();
    // Read as the eager step reads each micro-batch's loss (the same host sync in both).
    const double loss = static_loss.item<double>();
    if (step == t.steps && m == 0) r.graphed_first_loss = loss;
  }
  StepOutcome out;
  update(t.run, t.run.schedule.at(step), out);
}

// Graphed: `steps` more steps replayed, and the trial's graphed figures.
void measure_graphed(const Trial& t, CudaGraph& graph, const at::Tensor& inputs, const at::Tensor& targets,
                     const at::Tensor& static_loss, StaticGraphTrial& r) {
  // What the capture's warm-up run left cached is not the graph's: only the private pool, which
  // stays reserved while the graph lives, and what eager also holds count from here.
  cuda_empty_cache();
  cuda_reset_peak_stats(t.index);
  std::vector<double> graphed;
  for (int64_t step = t.steps; step < 2 * t.steps; ++step) {
    graphed.push_back(timed(t.index, [&] { replay_step(t, graph, inputs, targets, static_loss, step, r); }));
  }
  zero_grad(t.run.parameters());
  const CudaMemoryStats graphed_stats = cuda_memory_stats(t.index);
  r.captured = true;
  r.graphed_step_seconds = median_after_warmup(graphed);
  r.graphed_peak_reserved = graphed_stats.peak_reserved_bytes;
}

}  // namespace

StaticGraphTrial measure_static_graph(const RunConfig& cfg, int64_t steps) {
  if (steps < 2) fail("measure_static_graph: steps must be at least 2, got {}", steps);
  if (!resolve_device(cfg.device).is_cuda()) fail("static graphs are CUDA graphs: they need --device cuda");
  MadeRun made = make_run(cfg);
  if (!made.run) throw c10::OutOfMemoryError({__func__, __FILE__, __LINE__}, made.oom->message);
  Run& run = *made.run;
  const Trial t{run, cfg, steps, run.device.has_index() ? run.device.index() : 0,
                1.0 / static_cast<double>(cfg.accum)};

  StaticGraphTrial r;
  // The device's own statistics measure both: the monitor's per-phase peak resets would cut them up.
  run.monitor->set_enabled(false);
  measure_eager(t, r);

  const Batch first = run.data->train_batch(cfg.seed, steps, 0, cfg.batch);
  const at::Tensor static_inputs = first.inputs.to(run.device);
  const at::Tensor static_targets = first.targets.to(run.device);
  r.eager_first_loss = eager_first_loss(t, static_inputs, static_targets);

  allocate_gradients(t);
  at::Tensor static_loss;
  CudaGraph graph;
  if (!capture_step(t, graph, static_inputs, static_targets, static_loss, r)) return r;
  measure_graphed(t, graph, static_inputs, static_targets, static_loss, r);
  return r;
}

}  // namespace headroom
