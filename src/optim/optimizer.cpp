#include "optim/optimizer.h"

#include <ATen/ATen.h>

#include <unordered_set>

namespace headroom {

int64_t Optimizer::state_bytes() const {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& s : state()) {
    const auto& storage = s.tensor.storage();
    if (seen.insert(storage.unsafeGetStorageImpl()).second) bytes += static_cast<int64_t>(storage.nbytes());
  }
  return bytes;
}

void zero_grad(const std::vector<NamedTensor>& params) {
  for (const auto& p : params) p.tensor.mutable_grad().reset();
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
