// The optimizer implementations' shared machinery and constructors; make_optimizer() picks among
// them. Internal to optim/: callers use optimizer.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace headroom {

// Matrices decay; vectors (biases, norm weights) do not.
inline bool decays(const at::Tensor& param) { return param.dim() >= 2; }

// Advances per-parameter step counters by one without allocating: `add_(1.0)` would wrap the
// scalar in a tensor, an allocation that could fail half-way through an update. Counters of one
// optimizer advance together, so the first one's value stands for all.
inline void advance_steps(const std::vector<at::Tensor>& steps) {
  if (steps.empty()) return;
  const double next = steps[0].item<double>() + 1.0;
  for (const auto& s : steps) s.fill_(next);
}

// An optimizer over ATen's fused multi-tensor kernels. Each parameter has the same named state
// slots (e.g. exp_avg, exp_avg_sq, step), allocated up front by the subclass; parameters split into
// a decaying and a non-decaying group, and step() hands each group's parameters that have gradients,
// with their state, to update().
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
  FusedOptimizer(const std::vector<NamedTensor>& params, std::vector<std::string> slots,
                 const std::function<std::vector<at::Tensor>(const at::Tensor&)>& make_state, double weight_decay);
  virtual void update(Batch& batch, double lr, double weight_decay) = 0;

 private:
  struct Entry {
    std::string name;
    at::Tensor param;
    std::vector<at::Tensor> state;
  };
  std::vector<std::string> slot_names_;
  double weight_decay_;
  std::vector<Entry> decay_, no_decay_;
};

std::unique_ptr<Optimizer> make_sgd(const std::vector<NamedTensor>& params, const OptimizerOptions& options,
                                    bool momentum);
std::unique_ptr<Optimizer> make_adam(const std::vector<NamedTensor>& params, const OptimizerOptions& options,
                                     bool decoupled);
std::unique_ptr<Optimizer> make_adagrad(const std::vector<NamedTensor>& params, const OptimizerOptions& options);
std::unique_ptr<Optimizer> make_adafactor(const std::vector<NamedTensor>& params, const OptimizerOptions& options);

}  // namespace headroom
