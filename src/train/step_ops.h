// Step ops — the pieces of a training step that the trainer and the static-graph trial
// (train/static_graph.h) share, so that both run the same step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace headroom {

// Seeds dropout's randomness for optimizer step `step` (0-based) from (seed, step) alone, so a
// resumed or re-run step draws the same masks; data-parallel ranks other than 0 mix in their rank,
// so that their rows do not all get rank 0's masks.
void seed_step(uint64_t seed, int64_t step, int rank = 0);

// Mean cross-entropy over every token, computed in float32 whatever the logits' dtype.
at::Tensor token_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace headroom
