// SGD, with or without momentum, through ATen's fused kernel (_fused_sgd_): in place, no
// per-parameter temporaries. Weight decay is PyTorch's (an L2 term in the gradient), matrices only.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "optim/optimizers.h"

namespace headroom {
namespace {

class Sgd final : public Optimizer {
 public:
  Sgd(const std::vector<NamedTensor>& params, const OptimizerOptions& options, bool momentum)
      : options_(options), momentum_(momentum) {
    c10::NoGradGuard no_grad;
    for (const auto& p : params) {
      Slot s{p.name, p.tensor, momentum ? at::zeros_like(p.tensor, at::MemoryFormat::Contiguous) : at::Tensor()};
      (decays(p.tensor) ? decay_ : no_decay_).push_back(std::move(s));
    }
  }

  void step(double lr) override {
    c10::NoGradGuard no_grad;
    run(decay_, lr, options_.weight_decay);
    run(no_decay_, lr, 0.0);
  }

  std::vector<NamedTensor> state() const override {
    std::vector<NamedTensor> out;
    if (!momentum_) return out;
    for (const auto* group : {&decay_, &no_decay_}) {
      for (const Slot& s : *group) out.push_back({s.name + ".momentum_buffer", s.buffer});
    }
    return out;
  }

  std::string name() const override { return momentum_ ? "momentum" : "sgd"; }

 private:
  struct Slot {
    std::string name;
    at::Tensor param, buffer;
  };

  void run(std::vector<Slot>& group, double lr, double weight_decay) {
    std::vector<at::Tensor> params, grads, buffers;
    for (Slot& s : group) {
      if (!s.param.grad().defined()) continue;
      params.push_back(s.param);
      grads.push_back(s.param.grad());
      if (momentum_) buffers.push_back(s.buffer);
    }
    if (params.empty()) return;
    // Buffers start at zero, so buf = momentum * 0 + grad on the first step: PyTorch's first step.
    at::_fused_sgd_(params, grads, buffers, weight_decay, momentum_ ? options_.momentum : 0.0, lr,
                    /*dampening=*/0.0, /*nesterov=*/false, /*maximize=*/false, /*is_first_step=*/false);
  }

  OptimizerOptions options_;
  bool momentum_;
  std::vector<Slot> decay_, no_decay_;
};

}  // namespace

std::unique_ptr<Optimizer> make_sgd(const std::vector<NamedTensor>& params, const OptimizerOptions& options,
                                    bool momentum) {
  return std::make_unique<Sgd>(params, options, momentum);
}

}  // namespace headroom
