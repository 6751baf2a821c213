#include "dist/pipeline.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>

#include "optim/optimizer.h"
#include "util/error.h"

namespace headroom {

Pipeline::Pipeline(Communicator& comm, std::vector<LayerRange> ranges, bool tied_embeddings)
    : comm_(comm), ranges_(std::move(ranges)), tied_(tied_embeddings) {
  TORCH_CHECK(static_cast<int64_t>(ranges_.size()) == comm.size(), "Pipeline: ", ranges_.size(), " stages on ",
              comm.size(), " ranks");
  if (tied_ && (first() || last())) {
    ends_ = std::make_unique<Communicator>(comm_, std::vector<int>{0, static_cast<int>(stages() - 1)},
                                           "pipeline_tied_embeddings");
  }
}

Pipeline::~Pipeline() = default;

ModelStage Pipeline::model_stage() const { return {layers().first, layers().end, first(), last()}; }

void Pipeline::send_forward(const at::Tensor& output) { comm_.send(output.detach(), static_cast<int>(stage() + 1)); }

at::Tensor Pipeline::recv_forward(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor input = at::empty(shape, options);
  comm_.recv(input, static_cast<int>(stage() - 1));
  return input;
}

void Pipeline::send_backward(const at::Tensor& input_grad) {
  comm_.send(input_grad, static_cast<int>(stage() - 1));
}

at::Tensor Pipeline::recv_backward(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor grad = at::empty(shape, options);
  comm_.recv(grad, static_cast<int>(stage() + 1));
  return grad;
}

void Pipeline::finish_sends() { comm_.wait_sends(); }

namespace {
constexpr const char* kTied = "embed_tokens.weight";
}

void Pipeline::reduce_tied(const std::vector<NamedTensor>& params) {
  if (!ends_) return;
  const c10::NoGradGuard no_grad;
  for (const NamedTensor& p : params) {
    if (p.name != kTied) continue;
    at::Tensor grad = p.tensor.grad();
    if (!grad.defined()) {
      p.tensor.mutable_grad() = at::zeros_like(p.tensor);
      grad = p.tensor.grad();
    }
    ends_->allreduce(grad);
  }
}

double Pipeline::clip_grad_norm(const std::vector<NamedTensor>& params, double max_norm,
                                const std::function<void(at::Tensor&)>& within,
                                const std::function<double(const std::string&)>& share) {
  const c10::NoGradGuard no_grad;
  std::vector<at::Tensor> all, counted;
  std::vector<double> shares;
  for (const NamedTensor& p : params) {
    if (!p.tensor.grad().defined()) continue;
    all.push_back(p.tensor.grad());
    if (tied_ && !first() && p.name == kTied) continue;  // the first stage's copy counts
    counted.push_back(p.tensor.grad());
    shares.push_back(share ? share(p.name) : 1.0);
  }
  const double norm = gradient_norm_across(
      counted, shares,
      [&](at::Tensor& squares) {
        if (within) within(squares);
        comm_.allreduce(squares);
      },
      comm_.device());
  clip_to_norm(all, norm, max_norm);
  return norm;
}

double Pipeline::sum(double value) {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::kDouble).device(comm_.device()));
  comm_.allreduce(t);
  return t.item<double>();
}

bool Pipeline::any(bool flag) {
  at::Tensor t = at::full({1}, flag ? 1 : 0, at::TensorOptions().dtype(at::kInt).device(comm_.device()));
  comm_.allreduce(t, ReduceOp::max);
  return t.item<int>() != 0;
}

}  // namespace headroom
