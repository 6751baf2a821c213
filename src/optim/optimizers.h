// Constructors of the optimizer implementations, one per file; make_optimizer() picks among them.
// Internal to optim/: callers use optimizer.h.
#pragma once

#include <memory>
#include <vector>

#include "optim/optimizer.h"

namespace headroom {

std::unique_ptr<Optimizer> make_sgd(const std::vector<NamedTensor>& params, const OptimizerOptions& options,
                                    bool momentum);
std::unique_ptr<Optimizer> make_adam(const std::vector<NamedTensor>& params, const OptimizerOptions& options,
                                     bool decoupled);
std::unique_ptr<Optimizer> make_adagrad(const std::vector<NamedTensor>& params, const OptimizerOptions& options);
std::unique_ptr<Optimizer> make_adafactor(const std::vector<NamedTensor>& params, const OptimizerOptions& options);

// Splits parameters into those that decay (matrices) and those that do not (vectors).
inline bool decays(const at::Tensor& param) { return param.dim() >= 2; }

// Advances per-parameter step counters by one without allocating: `add_(1.0)` would wrap the
// scalar in a tensor, an allocation that could fail half-way through an update. Counters of one
// optimizer advance together, so the first one's value stands for all.
inline void advance_steps(const std::vector<at::Tensor>& steps) {
  if (steps.empty()) return;
  const double next = steps[0].item<double>() + 1.0;
  for (const auto& s : steps) s.fill_(next);
}

}  // namespace headroom
