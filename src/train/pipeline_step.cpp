#include "train/pipeline_step.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <deque>
#include <limits>

#include "device/autocast_adapter.h"
#include "train/step_ops.h"

namespace headroom {
namespace {

// What a stage keeps of a micro-batch between its forward and its backward.
struct InFlight {
  at::Tensor input;   // a later stage's: the received activations, recording their gradient
  at::Tensor output;  // this stage's output (the last stage's: its weighted loss)
};

at::TensorOptions activation_options(const Run& run) {
  return at::TensorOptions().dtype(run.model->parameters().front().tensor.scalar_type()).device(run.device);
}

// Sequence parallel: each tensor-parallel share sends its part of the tokens.
std::vector<int64_t> activation_shape(const Run& run, const at::Tensor& tokens) {
  const TensorSlice& tp = run.model->tensor_slice();
  return {tokens.size(0), tokens.size(1) / (tp.splits_sequence() ? tp.ranks : 1), run.model_config.hidden_size};
}

// This stage's forward of micro-batch `b`: its output, or on the last stage its loss.
InFlight stage_forward(Run& run, const MicroBatch& b, double& loss_sum) {
  Pipeline& pipe = *run.pipeline;
  InFlight f;
  auto phase = run.monitor->phase(Phase::forward);
  at::Tensor input = b.inputs;
  if (!pipe.first()) {
    f.input = pipe.recv_forward(activation_shape(run, b.inputs), activation_options(run));
    f.input.requires_grad_(true);
    input = f.input;
  }
  const AutocastScope autocast(run.device.type(), forward_autocast(run.config.precision));
  RouterOutput router;
  if (!pipe.last()) {
    const at::Tensor hidden = run.model->hidden_states(input, run.forward, &router);
    run.routing_skew = std::max(run.routing_skew, router.skew);
    TORCH_CHECK(hidden.scalar_type() == activation_options(run).dtype(), "pipeline: stage ", pipe.stage(),
                "'s output is ", hidden.scalar_type(), ", and the next stage expects ", activation_options(run).dtype());
    pipe.send_forward(hidden);
    f.output = hidden;
    return f;
  }
  const at::Tensor loss = model_loss(*run.model, input, b.targets, run.forward, run.config.loss, &router);
  run.routing_skew = std::max(run.routing_skew, router.skew);
  loss_sum += loss.item<double>() * b.weight;
  f.output = loss * b.weight;  // token-weighted, as backward_loss weighs a whole model's
  return f;
}

void stage_backward(Run& run, InFlight& f) {
  Pipeline& pipe = *run.pipeline;
  auto phase = run.monitor->phase(Phase::backward);
  at::Tensor grad;
  if (!pipe.last()) grad = pipe.recv_backward(f.output.sizes(), activation_options(run));
  // Data parallel within the stage: each micro-batch's gradients reduced as its backward completes
  // them (--shard gradients), or the hooks' bookkeeping only.
  if (run.replicas) run.replicas->begin_micro_batch();
  if (pipe.last()) {
    (run.scaler ? run.scaler->scale(f.output) : f.output).backward();
  } else {
    f.output.backward(grad);
  }
  if (run.replicas) run.replicas->end_backward();
  f.output.reset();
  if (!pipe.first()) pipe.send_backward(f.input.grad());
  f.input.reset();
}

}  // namespace

void run_pipeline_step(Run& run, const StepShape& shape, StepOutcome& out) {
  Pipeline& pipe = *run.pipeline;
  // Each stage and data-parallel rank its own masks; a stage's tensor-parallel shares (neighbours) the
  // same, as their replicated activations need.
  seed_step(run.config.seed, shape.step, run.rank() / (run.tensor ? run.tensor->ranks() : 1));
  out = StepOutcome{};
  double loss_sum = 0;
  std::deque<InFlight> in_flight;
  for (const PipelineSlot& slot : one_f_one_b(pipe.stage(), pipe.stages(), shape.accum())) {
    if (slot.forward) {
      const MicroBatch batch = load_micro_batch(run, shape, slot.micro);
      in_flight.push_back(stage_forward(run, batch, loss_sum));
    } else {
      stage_backward(run, in_flight.front());  // micro-batches finish in the order they started
      in_flight.pop_front();
    }
  }
  pipe.finish_sends();
  out.loss = pipe.sum(loss_sum);  // the last stage's, of this rank's rows
  if (run.replicas) out.loss = run.replicas->sum(out.loss);
  update(run, run.schedule.at(shape.step), out);
  clear_gradients(run);
}

double evaluate_pipeline(Run& run, int64_t rows) {
  Pipeline& pipe = *run.pipeline;
  const c10::NoGradGuard no_grad;
  const ForwardOptions eval_forward{run.config.attention, /*training=*/false, {}, run.forward.gate, nullptr};
  double loss_sum = 0;
  int64_t tokens = 0;
  for (const Batch& b : run.data->eval_batches(rows, run.config.eval_rows)) {
    const at::Tensor ids = b.inputs.to(run.device);
    at::Tensor input = ids;
    if (!pipe.first()) input = pipe.recv_forward(activation_shape(run, ids), activation_options(run));
    const AutocastScope autocast(run.device.type(), forward_autocast(run.config.precision));
    if (!pipe.last()) {
      pipe.send_forward(run.model->hidden_states(input, eval_forward));
      continue;
    }
    loss_sum += model_loss(*run.model, input, b.targets.to(run.device), eval_forward, run.config.loss).item<double>() *
                static_cast<double>(b.tokens());
    tokens += b.tokens();
  }
  pipe.finish_sends();
  const double total = pipe.sum(loss_sum);
  const double counted = pipe.sum(static_cast<double>(tokens));
  return counted > 0 ? total / counted : std::numeric_limits<double>::quiet_NaN();
}

}  // namespace headroom
