#include "dist/tensor_parallel_group.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

namespace headroom {

TensorParallelGroup::TensorParallelGroup(Communicator& comm) : comm_(comm) {
  slice_.rank = comm.rank();
  slice_.ranks = comm.size();
  slice_.allreduce = [this](at::Tensor& t, bool max) { comm_.allreduce(t, max ? ReduceOp::max : ReduceOp::sum); };
}

double TensorParallelGroup::clip_grad_norm(const std::vector<NamedTensor>& params, const CausalLM& model,
                                           double max_norm, const std::function<void(at::Tensor&)>& data_sum) {
  const c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  std::vector<double> shares;
  for (const NamedTensor& p : params) {
    if (!p.tensor.grad().defined()) continue;
    grads.push_back(p.tensor.grad());
    shares.push_back(1.0 / static_cast<double>(model.tensor_copies(p.name)));
  }
  at::Tensor squares = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
  if (!grads.empty()) {
    const at::Tensor each = at::stack(at::_foreach_norm(grads, 2)).to(at::kFloat).pow(2);
    const at::Tensor weights = at::tensor(shares, at::TensorOptions().dtype(at::kDouble)).to(each.device(), at::kFloat);
    squares = (each * weights).sum().reshape({1}).to(comm_.device());
  }
  if (data_sum) data_sum(squares);
  comm_.allreduce(squares);
  const double norm = std::sqrt(squares.item<double>());
  if (max_norm > 0 && norm > max_norm && !grads.empty()) at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
  return norm;
}

bool TensorParallelGroup::any(bool flag) {
  at::Tensor t = at::full({1}, flag ? 1 : 0, at::TensorOptions().dtype(at::kInt).device(comm_.device()));
  comm_.allreduce(t, ReduceOp::max);
  return t.item<int>() != 0;
}

}  // namespace headroom
