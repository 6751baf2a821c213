#include "dist/tensor_parallel_group.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

#include "optim/optimizer.h"

namespace headroom {

TensorParallelGroup::TensorParallelGroup(Communicator& comm, bool sequence) : comm_(comm) {
  slice_.rank = comm.rank();
  slice_.ranks = comm.size();
  slice_.sequence = sequence;
  slice_.allreduce = [this](at::Tensor& t, bool max) { comm_.allreduce(t, max ? ReduceOp::max : ReduceOp::sum); };
  // The collectives chunk along the first dimension: flat views of the [B, seq, hidden] tensors.
  slice_.allgather = [this](at::Tensor& out, at::Tensor& in) {
    at::Tensor flat_out = out.view({-1}), flat_in = in.view({-1});
    comm_.allgather(flat_out, flat_in);
  };
  slice_.reduce_scatter = [this](at::Tensor& out, at::Tensor& in) {
    at::Tensor flat_out = out.view({-1}), flat_in = in.view({-1});
    comm_.reduce_scatter(flat_out, flat_in);
  };
}

double TensorParallelGroup::clip_grad_norm(const std::vector<NamedTensor>& params, const CausalLM& model,
                                           double max_norm, const std::function<void(at::Tensor&)>& data_sum) {
  const c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  std::vector<double> shares;
  for (const NamedTensor& p : params) {
    if (!p.tensor.grad().defined()) continue;
    grads.push_back(p.tensor.grad());
    shares.push_back(share(model, p.name));
  }
  const double norm = gradient_norm_across(
      grads, shares,
      [&](at::Tensor& squares) {
        if (data_sum) data_sum(squares);
        comm_.allreduce(squares);
      },
      comm_.device());
  clip_to_norm(grads, norm, max_norm);
  return norm;
}

double TensorParallelGroup::share(const CausalLM& model, const std::string& name) {
  return 1.0 / static_cast<double>(model.tensor_copies(name));
}

bool TensorParallelGroup::any(bool flag) {
  at::Tensor t = at::full({1}, flag ? 1 : 0, at::TensorOptions().dtype(at::kInt).device(comm_.device()));
  comm_.allreduce(t, ReduceOp::max);
  return t.item<int>() != 0;
}

}  // namespace headroom
