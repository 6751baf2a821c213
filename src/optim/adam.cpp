// Adam and AdamW through ATen's fused kernels (_fused_adam_, _fused_adamw_), which update every
// parameter of a group in place with no per-parameter temporaries. Two groups: matrices decay,
// vectors do not.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "optim/optimizer.h"
#include "optim/optimizers.h"

namespace headroom {
namespace {

class Adam final : public Optimizer {
 public:
  Adam(const std::vector<NamedTensor>& params, const OptimizerOptions& options, bool decoupled)
      : options_(options), decoupled_(decoupled) {
    c10::NoGradGuard no_grad;
    for (const auto& p : params) {
      Slot s{p.name, p.tensor, at::zeros_like(p.tensor, at::MemoryFormat::Contiguous),
             at::zeros_like(p.tensor, at::MemoryFormat::Contiguous),
             at::zeros({}, p.tensor.options().dtype(at::kFloat))};
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
    for (const auto* group : {&decay_, &no_decay_}) {
      for (const Slot& s : *group) {
        out.push_back({s.name + ".exp_avg", s.exp_avg});
        out.push_back({s.name + ".exp_avg_sq", s.exp_avg_sq});
        out.push_back({s.name + ".step", s.step});
      }
    }
    return out;
  }

  std::string name() const override { return decoupled_ ? "adamw" : "adam"; }

 private:
  struct Slot {
    std::string name;
    at::Tensor param, exp_avg, exp_avg_sq, step;
  };

  void run(std::vector<Slot>& group, double lr, double weight_decay) {
    std::vector<at::Tensor> params, grads, m, v, steps;
    for (Slot& s : group) {
      if (!s.param.grad().defined()) continue;
      params.push_back(s.param);
      grads.push_back(s.param.grad());
      m.push_back(s.exp_avg);
      v.push_back(s.exp_avg_sq);
      steps.push_back(s.step);
    }
    if (params.empty()) return;
    advance_steps(steps);
    if (decoupled_) {
      at::_fused_adamw_(params, grads, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, options_.beta1, options_.beta2,
                        weight_decay, options_.eps, /*amsgrad=*/false, /*maximize=*/false);
    } else {
      at::_fused_adam_(params, grads, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, options_.beta1, options_.beta2,
                       weight_decay, options_.eps, /*amsgrad=*/false, /*maximize=*/false);
    }
  }

  OptimizerOptions options_;
  bool decoupled_;
  std::vector<Slot> decay_, no_decay_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adam(const std::vector<NamedTensor>& params, const OptimizerOptions& options,
                                     bool decoupled) {
  return std::make_unique<Adam>(params, options, decoupled);
}

}  // namespace headroom
