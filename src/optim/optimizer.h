// Optimizer — updates parameters from their gradients, holding its state as named tensors.
//
// State is allocated in the constructor, before the first step, so its memory is visible up front
// and a step never fails half-way for want of it. state() exposes every state tensor under a stable
// name for checkpoints; load by copying into those tensors. Not thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/causal_lm.h"

namespace headroom {

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // One update with learning rate `lr`; parameters without a gradient are skipped.
  virtual void step(double lr) = 0;

  // Every state tensor (moments, step counters), named "<param name>.<slot>".
  virtual std::vector<NamedTensor> state() const = 0;

  virtual std::string name() const = 0;

  // Bytes held by state(), shared storage counted once.
  int64_t state_bytes() const;
};

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // decoupled; applied to matrices only, not to biases and norm weights
};

std::unique_ptr<Optimizer> make_adamw(const std::vector<NamedTensor>& params, const AdamWOptions& options);

// Drops every parameter's gradient (set to undefined, so its memory is released).
void zero_grad(const std::vector<NamedTensor>& params);

// Scales gradients so that their global L2 norm is at most `max_norm` (no-op when max_norm <= 0).
// Returns the norm before clipping.
double clip_grad_norm(const std::vector<NamedTensor>& params, double max_norm);

}  // namespace headroom
