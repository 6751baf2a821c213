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

StaticGraphTrial measure_static_graph(const RunConfig& cfg, int64_t steps) {
  if (steps < 2) fail("measure_static_graph: steps must be at least 2, got {}", steps);
  if (!resolve_device(cfg.device).is_cuda()) fail("static graphs are CUDA graphs: they need --device cuda");
  MadeRun made = make_run(cfg);
  if (!made.run) throw c10::OutOfMemoryError({__func__, __FILE__, __LINE__}, made.oom->message);
  Run& run = *made.run;
  const std::vector<NamedTensor>& params = run.parameters();
  const int index = run.device.has_index() ? run.device.index() : 0;
  const StepShape first_shape{0, cfg.batch * cfg.accum, cfg.batch};
  const double weight = 1.0 / static_cast<double>(cfg.accum);  // equal micro-batches: token-weighted mean

  // The captured work: forward, loss and backward of one micro-batch, as the trainer's phases do them
  // (without the monitor's bookkeeping, which reads allocator statistics).
  auto loss_of = [&](const at::Tensor& inputs, const at::Tensor& targets) {
    const AutocastScope autocast(run.device.type(), forward_autocast(cfg.precision));
    return token_loss(run.model->forward(inputs, run.forward), targets);
  };
  auto backward = [&](const at::Tensor& loss) {
    const at::Tensor weighted = loss * weight;
    (run.scaler ? run.scaler->scale(weighted) : weighted).backward();
  };
  using Clock = std::chrono::steady_clock;
  auto timed = [&](auto&& body) {
    cuda_synchronize(index);
    const auto t0 = Clock::now();
    body();
    cuda_synchronize(index);
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };

  StaticGraphTrial r;
  // The device's own statistics measure both: the monitor's per-phase peak resets would cut them up.
  run.monitor->set_enabled(false);
  // Eager: the trainer's own step.
  cuda_empty_cache();
  cuda_reset_peak_stats(index);
  std::vector<double> eager;
  for (int64_t step = 0; step < steps; ++step) {
    eager.push_back(timed([&] {
      StepShape shape = first_shape;
      shape.step = step;
      StepOutcome out;
      run_step(run, shape, out);
    }));
  }
  const CudaMemoryStats eager_stats = cuda_memory_stats(index);
  r.eager_step_seconds = median_after_warmup(eager);
  r.eager_peak_reserved = eager_stats.peak_reserved_bytes;
  r.eager_peak_allocated = eager_stats.peak_allocated_bytes;

  // The first micro-batch of the next step, eagerly, on the weights the graph starts from.
  const Batch first = run.data->train_batch(cfg.seed, steps, 0, cfg.batch);
  const at::Tensor static_inputs = first.inputs.to(run.device);
  const at::Tensor static_targets = first.targets.to(run.device);
  {
    const c10::NoGradGuard no_grad;
    seed_step(cfg.seed, steps);
    r.eager_first_loss = loss_of(static_inputs, static_targets).item<double>();
  }

  // Graphed: gradients exist before the capture, so that the captured backward adds into them.
  cuda_empty_cache();
  cuda_reset_peak_stats(index);
  for (const auto& p : params) p.tensor.mutable_grad() = at::zeros_like(p.tensor);
  at::Tensor static_loss;
  CudaGraph graph;
  try {
    if (cfg.checkpointing.kind != CheckpointPolicy::Kind::none) {
      fail(
          "activation checkpointing saves and restores the CUDA random-number state for its recompute, which a "
          "capture cannot read");
    }
    graph.capture(index, [&] {
      static_loss = loss_of(static_inputs, static_targets);
      backward(static_loss);
    });
  } catch (const Error& e) {
    r.failure = e.what();
    zero_grad(params);
    return r;
  }
  // What the capture's warm-up run left cached is not the graph's: only the private pool, which
  // stays reserved while the graph lives, and what eager also holds count from here.
  cuda_empty_cache();
  cuda_reset_peak_stats(index);
  std::vector<double> graphed;
  for (int64_t step = steps; step < 2 * steps; ++step) {
    graphed.push_back(timed([&] {
      for (const auto& p : params) p.tensor.grad().zero_();  // in place: the graph writes into these
      seed_step(cfg.seed, step);
      for (int64_t m = 0; m < cfg.accum; ++m) {
        if (step > steps || m > 0) {
          const Batch b = run.data->train_batch(cfg.seed, step, m * cfg.batch, cfg.batch);
          static_inputs.copy_(b.inputs);
          static_targets.copy_(b.targets);
        }
        graph.replay();
        // Read as the eager step reads each micro-batch's loss (the same host sync in both).
        const double loss = static_loss.item<double>();
        if (step == steps && m == 0) r.graphed_first_loss = loss;
      }
      StepOutcome out;
      update(run, run.schedule.at(step), out);
    }));
  }
  zero_grad(params);
  const CudaMemoryStats graphed_stats = cuda_memory_stats(index);
  r.captured = true;
  r.graphed_step_seconds = median_after_warmup(graphed);
  r.graphed_peak_reserved = graphed_stats.peak_reserved_bytes;
  return r;
}

}  // namespace headroom
