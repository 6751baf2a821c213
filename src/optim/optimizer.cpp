#include "optim/optimizer.h"

#include <ATen/ATen.h>

#include <cmath>

#include "optim/optimizers.h"
#include "util/error.h"
#include "util/tensor_bytes.h"

namespace headroom {

int64_t Optimizer::state_bytes() const {
  std::vector<at::Tensor> tensors;
  for (const auto& s : state()) tensors.push_back(s.tensor);
  return storage_bytes(tensors);
}

bool is_matrix(const NamedTensor& param, const OptimizerOptions& options) {
  if (!options.sharding) return param.tensor.dim() >= 2;
  for (const auto& p : options.sharding->parameters) {
    if (p.name == param.name) return p.sizes.size() >= 2;
  }
  fail("the optimizer's tensor '{}' is no parameter of the sharded model", param.name);
}

std::unique_ptr<Optimizer> make_optimizer(OptimizerKind kind, const std::vector<NamedTensor>& params,
                                          const OptimizerOptions& options) {
  switch (kind) {
    case OptimizerKind::sgd: return make_sgd(params, options, /*momentum=*/false);
    case OptimizerKind::momentum: return make_sgd(params, options, /*momentum=*/true);
    case OptimizerKind::adam: return make_adam(params, options, /*decoupled=*/false);
    case OptimizerKind::adamw: return make_adam(params, options, /*decoupled=*/true);
    case OptimizerKind::adagrad: return make_adagrad(params, options);
    case OptimizerKind::adafactor: return make_adafactor(params, options);
    case OptimizerKind::adamw8bit: return make_adamw8bit(params, options);
  }
  fail("unknown optimizer");
}

void zero_grad(const std::vector<NamedTensor>& params) {
  for (const auto& p : params) p.tensor.mutable_grad().reset();
}

double gradient_norm_across(const std::vector<at::Tensor>& grads, const std::vector<double>& shares,
                            const std::function<void(at::Tensor&)>& sum, const c10::Device& device) {
  at::Tensor squares = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  if (!grads.empty()) {
    const at::Tensor each = at::stack(at::_foreach_norm(grads, 2)).to(at::kFloat).pow(2);
    const at::Tensor weights = at::tensor(shares, at::TensorOptions().dtype(at::kDouble)).to(each.device(), at::kFloat);
    squares = (each * weights).sum().reshape({1}).to(device);
  }
  sum(squares);
  return std::sqrt(squares.item<double>());
}

void clip_to_norm(const std::vector<at::Tensor>& grads, double norm, double max_norm) {
  if (max_norm > 0 && norm > max_norm && !grads.empty()) at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
}

double clip_grad_norm(const std::vector<NamedTensor>& params, double max_norm) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    if (p.tensor.grad().defined()) grads.push_back(p.tensor.grad());
  }
  if (grads.empty()) return 0.0;
  auto norms = at::_foreach_norm(grads, 2);
  auto total = at::stack(norms).to(at::kFloat).norm(2);
  const double norm = total.item<double>();
  if (max_norm > 0 && norm > max_norm) {
    at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
  }
  return norm;
}

}  // namespace headroom
