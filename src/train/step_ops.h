// Step ops — the pieces of a training step that the trainer and the static-graph trial
// (train/static_graph.h) share, so that both run the same step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace headroom {

// Seeds dropout's randomness for optimizer step `step` (0-based) from (seed, step) alone, so a
// resumed or re-run step draws the same masks.
void seed_step(uint64_t seed, int64_t step);

// Mean cross-entropy over every token, computed in float32 whatever the logits' dtype.
at::Tensor token_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace headroom
