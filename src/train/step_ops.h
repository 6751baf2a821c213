// Step ops — the pieces of a training step that the trainer and the static-graph trial
// (train/static_graph.h) share, so that both run the same step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "config/loss.h"
#include "model/causal_lm.h"

namespace headroom {

// Seeds dropout's randomness for optimizer step `step` (0-based) from (seed, step) alone, so a
// resumed or re-run step draws the same masks; data-parallel ranks other than 0 mix in their rank,
// so that their rows do not all get rank 0's masks.
void seed_step(uint64_t seed, int64_t step, int rank = 0);

// Mean cross-entropy over every token, computed in float32 whatever the logits' dtype.
at::Tensor token_loss(const at::Tensor& logits, const at::Tensor& targets);

// The model's loss on a batch as --loss says: its logits then token_loss (full), or its hidden
// states through the head and the loss a chunk of tokens at a time (model/chunked_loss.h).
// `outputs`, when given, receives what the forward produced (the logits, or the hidden states).
at::Tensor model_loss(const CausalLM& model, const at::Tensor& inputs, const at::Tensor& targets,
                      const ForwardOptions& options, const LossSetting& loss, RouterOutput* router = nullptr,
                      at::Tensor* outputs = nullptr);

// The loss of a model's final hidden states [B, T, hidden] through its head, as model_loss computes
// it after the trunk (a pipeline's last stage).
at::Tensor head_loss(const CausalLM& model, const at::Tensor& hidden, const at::Tensor& targets,
                     const LossSetting& loss);

}  // namespace headroom
