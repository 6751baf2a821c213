#include "train/static_graph.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <vector>

#include "config/model_config.h"
#include "data/text_dataset.h"
#include "device/autocast_adapter.h"
#include "device/cuda_adapter.h"
#include "device/cuda_graph.h"
#include "device/device.h"
#include "model/causal_lm.h"
#include "optim/optimizer.h"
#include "train/precision.h"
#include "train/step_ops.h"
#include "util/error.h"

namespace headroom {
namespace {

double median_after_first(std::vector<double> t) {
  if (t.size() > 1) t.erase(t.begin());
  std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
  return t[t.size() / 2];
}

}  // namespace

StaticGraphTrial measure_static_graph(const RunConfig& cfg, int64_t steps) {
  validate(cfg);
  const at::Device device = resolve_device(cfg.device);
  if (!device.is_cuda()) fail("static graphs are CUDA graphs: they need --device cuda");
  if (steps < 2) fail("measure_static_graph: steps must be at least 2, got {}", steps);
  const Precision precision = parse_precision(cfg.precision);
  const ForwardOptions forward{parse_attention_path(cfg.attention), /*training=*/true,
                               parse_checkpoint_policy(cfg.checkpointing)};
  const ModelConfig model_cfg = load_model_config(cfg.model, cfg.overrides);
  const TextDataset data = TextDataset::load(cfg.data, 0.1, cfg.seq);
  const CausalLM model(model_cfg, at::TensorOptions().dtype(parameter_dtype(precision)).device(device), cfg.seed);
  const std::vector<NamedTensor>& params = model.parameters();
  OptimizerOptions optimizer_options;
  optimizer_options.weight_decay = cfg.weight_decay_value();
  const auto optimizer = make_optimizer(parse_optimizer(cfg.optimizer), params, optimizer_options);
  std::optional<LossScaler> scaler;
  if (precision == Precision::fp16_mixed) scaler.emplace(device);
  const double weight = 1.0 / static_cast<double>(cfg.accum);  // equal micro-batches: token-weighted mean
  const int index = device.has_index() ? device.index() : 0;

  auto loss_of = [&](const at::Tensor& inputs, const at::Tensor& targets) {
    const AutocastScope autocast(device.type(), forward_autocast(precision));
    return token_loss(model.forward(inputs, forward), targets);
  };
  auto backward = [&](const at::Tensor& loss) {
    const at::Tensor weighted = loss * weight;
    (scaler ? scaler->scale(weighted) : weighted).backward();
  };
  auto update = [&] {
    std::vector<at::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.tensor.grad());
    if (!(scaler && scaler->unscale(grads))) {
      clip_grad_norm(params, cfg.grad_clip);
      optimizer->step(cfg.lr);
    }
    if (scaler) scaler->update();
  };
  auto batch = [&](int64_t step, int64_t m) { return data.train_batch(cfg.seed, step, m * cfg.batch, cfg.batch); };
  using Clock = std::chrono::steady_clock;
  auto timed = [&](auto&& body) {
    cuda_synchronize(index);
    const auto t0 = Clock::now();
    body();
    cuda_synchronize(index);
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };

  StaticGraphTrial r;
  // Eager, as the trainer runs it.
  cuda_empty_cache();
  cuda_reset_peak_stats(index);
  std::vector<double> eager;
  for (int64_t step = 0; step < steps; ++step) {
    eager.push_back(timed([&] {
      seed_step(cfg.seed, step);
      for (int64_t m = 0; m < cfg.accum; ++m) {
        const Batch b = batch(step, m);
        const at::Tensor loss = loss_of(b.inputs.to(device), b.targets.to(device));
        backward(loss);
      }
      update();
      zero_grad(params);
    }));
  }
  const CudaMemoryStats eager_stats = cuda_memory_stats(index);
  r.eager_step_seconds = median_after_first(eager);
  r.eager_peak_reserved = eager_stats.peak_reserved_bytes;
  r.eager_peak_allocated = eager_stats.peak_allocated_bytes;

  // The first micro-batch of the next step, eagerly, on the weights the graph starts from.
  const Batch first = batch(steps, 0);
  const at::Tensor static_inputs = first.inputs.to(device);
  const at::Tensor static_targets = first.targets.to(device);
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
    if (forward.checkpoint.kind != CheckpointPolicy::Kind::none) {
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
          const Batch b = batch(step, m);
          static_inputs.copy_(b.inputs);
          static_targets.copy_(b.targets);
        }
        graph.replay();
        if (step == steps && m == 0) r.graphed_first_loss = static_loss.item<double>();
      }
      update();
    }));
  }
  zero_grad(params);
  const CudaMemoryStats graphed_stats = cuda_memory_stats(index);
  r.captured = true;
  r.graphed_step_seconds = median_after_first(graphed);
  r.graphed_peak_reserved = graphed_stats.peak_reserved_bytes;
  return r;
}

}  // namespace headroom
