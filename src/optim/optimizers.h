// The optimizer implementations' shared machinery and constructors; make_optimizer() picks among
// them. Internal to optim/: callers use optimizer.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace headroom {

// Matrices decay; vectors (biases, norm weights) do not.
inline bool decays(const NamedTensor& param, const OptimizerOptions& options) { return is_matrix(param, options); }

// An optimizer over ATen's fused multi-tensor kernels. Each parameter has the same named state
// slots (e.g. exp_avg, exp_avg_sq, step), allocated up front by the subclass; parameters split into
// a decaying and a non-decaying group, and step() hands each group's parameters that have gradients,
// with their state, to update(). When a slot is a step counter, step() advances each parameter's
// own counter first (a parameter without a gradient keeps its count), with fill_ from a host-side
// copy: add_(1.0) would wrap the scalar in a tensor, an allocation that could fail half-way through
// an update. The host copies are read from the tensors at the first step, after any checkpoint load.
class FusedOptimizer : public Optimizer {
 public:
  void step(double lr) override;
  std::vector<NamedTensor> state() const override;

 protected:
  struct Batch {
    std::vector<at::Tensor> params, grads;
    std::vector<std::vector<at::Tensor>> slots;  // slots[k][i]: slot k of params[i]
  };
  // `slots` names the state of each parameter; `make_state` allocates it, in that order.
  // `step_slot`: the index of the step-counter slot, or -1 when there is none.
  FusedOptimizer(const std::vector<NamedTensor>& params, std::vector<std::string> slots, int step_slot,
                 const std::function<std::vector<at::Tensor>(const at::Tensor&)>& make_state,
                 const OptimizerOptions& options);
  virtual void update(Batch& batch, double lr, double weight_decay) = 0;

 private:
  struct Entry {
    std::string name;
    at::Tensor param;
    std::vector<at::Tensor> state;
    int64_t steps = -1;  // host copy of the step counter; -1: not read yet
  };
  std::vector<std::string> slot_names_;
  int step_slot_;
  double weight_decay_;
  std::vector<Entry> decay_, no_decay_;
};

std::unique_ptr<Optimizer> make_sgd(const std::vector<NamedTensor>& params, const OptimizerOptions& options,
                                    bool momentum);
std::unique_ptr<Optimizer> make_adam(const std::vector<NamedTensor>& params, const OptimizerOptions& options,
                                     bool decoupled);
std::unique_ptr<Optimizer> make_adagrad(const std::vector<NamedTensor>& params, const OptimizerOptions& options);
std::unique_ptr<Optimizer> make_adamw8bit(const std::vector<NamedTensor>& params, const OptimizerOptions& options);
std::unique_ptr<Optimizer> make_adafactor(const std::vector<NamedTensor>& params, const OptimizerOptions& options);

}  // namespace headroom
