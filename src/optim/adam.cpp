// Adam and AdamW through ATen's fused kernels (_fused_adam_, _fused_adamw_): every parameter of a
// group updated in place, no per-parameter temporaries. Adam's weight decay is an L2 term in the
// gradient, AdamW's is decoupled.
#include <ATen/ATen.h>

#include "optim/optimizers.h"

namespace headroom {
namespace {

class Adam final : public FusedOptimizer {
 public:
  Adam(const std::vector<NamedTensor>& params, const OptimizerOptions& options, bool decoupled)
      : FusedOptimizer(params, {"exp_avg", "exp_avg_sq", "step"}, /*step_slot=*/2,
                       [](const at::Tensor& p) {
                         return std::vector<at::Tensor>{at::zeros_like(p, at::MemoryFormat::Contiguous),
                                                        at::zeros_like(p, at::MemoryFormat::Contiguous),
                                                        at::zeros({}, p.options().dtype(at::kFloat))};
                       },
                       options),
        options_(options),
        decoupled_(decoupled) {}

  std::string name() const override { return decoupled_ ? "adamw" : "adam"; }

 private:
  void update(Batch& b, double lr, double weight_decay) override {
    if (decoupled_) {
      at::_fused_adamw_(b.params, b.grads, b.slots[0], b.slots[1], /*max_exp_avg_sqs=*/{}, b.slots[2], lr,
                        options_.beta1, options_.beta2, weight_decay, options_.eps, /*amsgrad=*/false,
                        /*maximize=*/false);
    } else {
      at::_fused_adam_(b.params, b.grads, b.slots[0], b.slots[1], /*max_exp_avg_sqs=*/{}, b.slots[2], lr,
                       options_.beta1, options_.beta2, weight_decay, options_.eps, /*amsgrad=*/false,
                       /*maximize=*/false);
    }
  }

  OptimizerOptions options_;
  bool decoupled_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adam(const std::vector<NamedTensor>& params, const OptimizerOptions& options,
                                     bool decoupled) {
  return std::make_unique<Adam>(params, options, decoupled);
}

}  // namespace headroom
