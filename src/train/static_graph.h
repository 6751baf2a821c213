// Static graph — lever 7, measured rather than assumed: the same training step run eagerly and as a
// replayed CUDA graph, on the same model, one after the other, with the step time and the memory
// each takes.
//
// The graphed step captures forward, loss and backward of one micro-batch (as PyTorch's
// make_graphed_callables does); each micro-batch copies its tokens into the captured inputs and
// replays; gradients accumulate in place in buffers allocated before the capture; clipping, the
// optimizer update and fp16 loss scaling run eagerly between replays. Memory is compared as peak
// reserved bytes, because a graph's intermediates live in its private pool, which the caching
// allocator counts as reserved, not allocated, between replays. cuda only.
#pragma once

#include <cstdint>
#include <string>

#include "config/run_config.h"

namespace headroom {

struct StaticGraphTrial {
  bool captured = false;
  std::string failure;  // why the step could not be captured (then only the eager figures are set)
  double eager_step_seconds = 0, graphed_step_seconds = 0;  // medians, the first step of each left out
  int64_t eager_peak_reserved = 0, graphed_peak_reserved = 0;
  int64_t eager_peak_allocated = 0;
  // The loss of the first micro-batch, eager and replayed, on the same weights and tokens: equal up
  // to kernel rounding when the model has no dropout (the graph draws its own dropout masks).
  double eager_first_loss = 0, graphed_first_loss = 0;
};

// Trains `steps` eager steps (the trainer's own step, train/step.h), then captures the step and
// replays it for `steps` more, from `config` (model, micro-batch, accumulation, precision,
// checkpointing, attention, optimizer, seed; no budget, outputs or guard). Throws Error unless
// config.device is cuda, and c10::OutOfMemoryError when the model or the eager step does not fit
// the card.
StaticGraphTrial measure_static_graph(const RunConfig& config, int64_t steps);

}  // namespace headroom
