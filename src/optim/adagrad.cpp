// Adagrad through ATen's fused kernel (_fused_adagrad_): in place, no per-parameter temporaries.
// PyTorch's defaults: eps 1e-10, no learning-rate decay, accumulators start at zero.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "optim/optimizers.h"

namespace headroom {
namespace {

class Adagrad final : public Optimizer {
 public:
  Adagrad(const std::vector<NamedTensor>& params, const OptimizerOptions& options) : options_(options) {
    c10::NoGradGuard no_grad;
    for (const auto& p : params) {
      Slot s{p.name, p.tensor, at::zeros_like(p.tensor, at::MemoryFormat::Contiguous),
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
        out.push_back({s.name + ".sum", s.sum});
        out.push_back({s.name + ".step", s.step});
      }
    }
    return out;
  }

  std::string name() const override { return "adagrad"; }

 private:
  struct Slot {
    std::string name;
    at::Tensor param, sum, step;
  };

  void run(std::vector<Slot>& group, double lr, double weight_decay) {
    std::vector<at::Tensor> params, grads, sums, steps;
    for (Slot& s : group) {
      if (!s.param.grad().defined()) continue;
      params.push_back(s.param);
      grads.push_back(s.param.grad());
      sums.push_back(s.sum);
      steps.push_back(s.step);
    }
    if (params.empty()) return;
    advance_steps(steps);
    at::_fused_adagrad_(params, grads, sums, steps, lr, /*lr_decay=*/0.0, weight_decay, /*eps=*/1e-10,
                        /*maximize=*/false);
  }

  OptimizerOptions options_;
  std::vector<Slot> decay_, no_decay_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adagrad(const std::vector<NamedTensor>& params, const OptimizerOptions& options) {
  return std::make_unique<Adagrad>(params, options);
}

}  // namespace headroom
