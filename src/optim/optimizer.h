// Optimizer — updates parameters from their gradients, holding its state as named tensors.
//
// State is allocated in the constructor, before the first step, so its memory is visible up front
// and a step never fails half-way for want of it. state() exposes every state tensor under a stable
// name for checkpoints; load by copying into those tensors. Not thread-safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/optimizer_kind.h"
#include "util/named_tensor.h"

namespace headroom {

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // One update with learning rate `lr`; parameters without a gradient are skipped.
  virtual void step(double lr) = 0;

  // Every state tensor (moments, step counters), named "<param name>.<slot>".
  virtual std::vector<NamedTensor> state() const = 0;

  virtual std::string name() const = 0;

  // Memory the optimizer holds besides its state (adafactor's scratch buffer): counted as optimizer
  // memory, not checkpointed.
  virtual std::vector<at::Tensor> working_memory() const { return {}; }

  // Whether the state tensor of this name describes its parameter as a whole even when the optimizer
  // updates a slice (adafactor's factored moments: every rank holds all of them, the same values).
  // Any other state tensor has one element per element of what is updated, or is a step counter.
  virtual bool whole_parameter_state(const std::string& /*name*/) const { return false; }

  // Whether state() and working_memory() are in host memory, not on the parameters' device
  // (optim/offload.h).
  virtual bool offloaded() const { return false; }
  // Host memory an offloaded optimizer holds besides its state: its copies of the parameters and
  // of their gradients, in pairs (a parameter's copy, then its gradient's), in parameter order.
  virtual std::vector<at::Tensor> host_copies() const { return {}; }

  // Bytes held by state(), shared storage counted once.
  int64_t state_bytes() const;
};

// This rank's part of one parameter, when ranks share the optimizer's work (dist/data_parallel.h).
struct ParameterSlice {
  std::string name;
  std::vector<int64_t> sizes;     // the whole parameter's shape
  int64_t start = 0, length = 0;  // the part's elements of the flattened parameter (length 0: none here)
};

struct OptimizerSharding {
  std::vector<ParameterSlice> parameters;  // every parameter of the model, in the same order on every rank
  // Sums a float32 tensor over the ranks, in place; every rank calls it at the same point of a step.
  std::function<void(at::Tensor&)> sum;
};

// Weight decay applies to matrices only, never to biases and norm weights. Its meaning follows
// PyTorch's optimizer of the same name: decoupled (p *= 1 - lr * wd) for adamw and adafactor, an L2
// term added to the gradient for sgd, momentum, adam and adagrad.
struct OptimizerOptions {
  double beta1 = 0.9;   // adam, adamw
  double beta2 = 0.95;  // adam, adamw
  double eps = 1e-8;    // adam, adamw; adagrad uses 1e-10 as PyTorch does
  double weight_decay = 0.0;
  double momentum = 0.9;      // momentum
  double beta2_decay = -0.8;  // adafactor: beta2_t = 1 - step^beta2_decay
  double adafactor_eps2 = 1e-3;
  double adafactor_clip = 1.0;  // d: the update's RMS is clipped to this
  // Set when the optimizer's tensors are this rank's 1-D slices of the parameters
  // (dist/data_parallel.h): their shapes do not say which are matrices, and adafactor's per-matrix
  // statistics need the other ranks' parts.
  std::optional<OptimizerSharding> sharding;
};

// Whether the parameter of this name is a matrix (weight decay applies; adafactor factors it).
bool is_matrix(const NamedTensor& param, const OptimizerOptions& options);

// The optimizer's state tensors are allocated here, before the first step:
//   sgd        none
//   momentum   one buffer per parameter (1x)
//   adam/adamw exp_avg and exp_avg_sq (2x), and a float step counter per tensor
//   adagrad    the sum of squares (1x), and a step counter per tensor
//   adafactor  for a matrix, row and column second-moment estimates (rows + columns, whole even when
//              sharded); for a vector, a full second moment (of the slice when sharded); a step
//              counter per tensor; plus a float32 scratch buffer the size of the largest parameter (its
//              slice's rows when sharded) and the per-step statistics (rows + columns of each matrix,
//              two numbers per parameter), so that a step allocates no parameter-sized temporaries
std::unique_ptr<Optimizer> make_optimizer(OptimizerKind kind, const std::vector<NamedTensor>& params,
                                          const OptimizerOptions& options);

// Drops every parameter's gradient (set to undefined, so its memory is released).
void zero_grad(const std::vector<NamedTensor>& params);

// Scales gradients so that their global L2 norm is at most `max_norm` (no-op when max_norm <= 0).
// Returns the norm before clipping.
double clip_grad_norm(const std::vector<NamedTensor>& params, double max_norm);

// The global L2 norm of gradients spread over ranks: this rank's `grads`, each counted `shares[i]`
// times (1 / the ranks holding a copy of it), their weighted squares summed over the ranks by `sum`,
// in float32 on `device`.
double gradient_norm_across(const std::vector<at::Tensor>& grads, const std::vector<double>& shares,
                            const std::function<void(at::Tensor&)>& sum, const c10::Device& device);
// Scales `grads` so that a global norm of `norm` becomes `max_norm` (no-op when it is already at
// most that, or max_norm <= 0), as clip_grad_norm does.
void clip_to_norm(const std::vector<at::Tensor>& grads, double norm, double max_norm);

}  // namespace headroom
