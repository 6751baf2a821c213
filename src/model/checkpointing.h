// Activation checkpointing: a block's forward runs without keeping its activations; backward runs
// it again (recompute) to get them, then backpropagates through it.
//
// Implemented as a custom autograd function: forward saves only the block's input, the RNG state
// and the autocast state; backward restores both before recomputing, so dropout masks and
// precisions match and the gradients equal the non-checkpointed ones.
//
// Which blocks are checkpointed is the run's CheckpointPolicy (config/checkpoint_policy.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "config/checkpoint_policy.h"

namespace headroom {

// What a checkpointed block keeps besides its input (per-op checkpointing's kept outputs,
// model/op_checkpoint.h): entered around the forward's run of fn (`recompute` false) and around
// the recompute's (true), left after each.
class CheckpointFrame {
 public:
  virtual ~CheckpointFrame() = default;
  virtual void enter(bool recompute) = 0;
  virtual void leave() = 0;
};

// y = fn(x), recomputed in backward instead of kept. `fn` must be a pure function of x and of
// tensors that outlive the backward pass (parameters); it is called again from backward. When x
// does not require a gradient, fn runs plainly (not checkpointed), so parameter gradients still flow.
at::Tensor checkpointed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x,
                        std::shared_ptr<CheckpointFrame> frame = nullptr);

}  // namespace headroom
