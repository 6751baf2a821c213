#include "device/grad_hook_adapter.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>

namespace headroom {
namespace {

struct Hook final : torch::autograd::PostAccumulateGradHook {
  explicit Hook(std::function<void(const at::Tensor&)> f) : fn(std::move(f)) {}
  void operator()(const torch::autograd::Variable& tensor) override { fn(tensor); }
  std::function<void(const at::Tensor&)> fn;
};

}  // namespace

void set_gradient_accumulated_hook(const at::Tensor& leaf, std::function<void(const at::Tensor&)> hook) {
  torch::autograd::impl::set_post_acc_grad_hooks(leaf, std::make_unique<Hook>(std::move(hook)));
}

void clear_gradient_accumulated_hook(const at::Tensor& leaf) {
  torch::autograd::impl::post_acc_grad_hooks(leaf).reset();
}

}  // namespace headroom
