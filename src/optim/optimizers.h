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

}  // namespace headroom
