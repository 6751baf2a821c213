// Activation checkpointing: a block's forward runs without keeping its activations; backward runs
// it again (recompute) to get them, then backpropagates through it.
//
// Implemented as a custom autograd function: forward saves only the block's input, the RNG state
// and the autocast state; backward restores both before recomputing, so dropout masks and
// precisions match and the gradients equal the non-checkpointed ones.
//
// Policies (--checkpointing): none; selective — only the attention sub-block of every layer;
// every:K — whole layers 0, K, 2K, ...; full — every layer.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>

namespace headroom {

struct CheckpointPolicy {
  enum class Kind { none, selective, every, full };
  Kind kind = Kind::none;
  int64_t every = 1;  // K, for Kind::every

  bool whole_layer(int64_t layer) const {
    return kind == Kind::full || (kind == Kind::every && layer % every == 0);
  }
  bool attention_only() const { return kind == Kind::selective; }
  std::string name() const;  // "none", "selective", "every:4", "full"
};

// Throws Error naming the accepted forms.
CheckpointPolicy parse_checkpoint_policy(const std::string& text);

// y = fn(x), recomputed in backward instead of kept. `fn` must be a pure function of x and of
// tensors that outlive the backward pass (parameters); it is called again from backward. When x
// does not require a gradient, fn runs plainly (not checkpointed), so parameter gradients still flow.
at::Tensor checkpointed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x);

}  // namespace headroom
