// AdamW through ATen's fused kernel (_fused_adamw_), which updates every parameter of a group in
// place with no per-parameter temporaries. Two groups: matrices decay, vectors do not.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "optim/optimizer.h"

namespace headroom {
namespace {

class AdamW final : public Optimizer {
 public:
  AdamW(const std::vector<NamedTensor>& params, const AdamWOptions& options) : options_(options) {
    c10::NoGradGuard no_grad;
    for (const auto& p : params) {
      Slot s{p.name, p.tensor, at::zeros_like(p.tensor, at::MemoryFormat::Contiguous),
             at::zeros_like(p.tensor, at::MemoryFormat::Contiguous),
             at::zeros({}, p.tensor.options().dtype(at::kFloat))};
      (p.tensor.dim() >= 2 ? decay_ : no_decay_).push_back(std::move(s));
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

  std::string name() const override { return "adamw"; }

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
    at::_foreach_add_(steps, 1.0);
    at::_fused_adamw_(params, grads, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, options_.beta1, options_.beta2,
                      weight_decay, options_.eps, /*amsgrad=*/false, /*maximize=*/false);
  }

  AdamWOptions options_;
  std::vector<Slot> decay_, no_decay_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adamw(const std::vector<NamedTensor>& params, const AdamWOptions& options) {
  return std::make_unique<AdamW>(params, options);
}

}  // namespace headroom
