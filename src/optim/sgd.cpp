// SGD, with or without momentum, through ATen's fused kernel (_fused_sgd_): in place, no
// per-parameter temporaries. Weight decay is PyTorch's (an L2 term in the gradient).
#include <ATen/ATen.h>

#include "optim/optimizers.h"

namespace headroom {
namespace {

class Sgd final : public FusedOptimizer {
 public:
  Sgd(const std::vector<NamedTensor>& params, const OptimizerOptions& options, bool momentum)
      : FusedOptimizer(params, momentum ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{},
                       /*step_slot=*/-1,
                       [momentum](const at::Tensor& p) {
                         return momentum ? std::vector<at::Tensor>{at::zeros_like(p, at::MemoryFormat::Contiguous)}
                                         : std::vector<at::Tensor>{};
                       },
                       options),
        momentum_(momentum ? options.momentum : 0.0) {}

  std::string name() const override { return momentum_ > 0 ? "momentum" : "sgd"; }

 private:
  void update(Batch& b, double lr, double weight_decay) override {
    // Buffers start at zero, so buf = momentum * 0 + grad on the first step: PyTorch's first step.
    at::_fused_sgd_(b.params, b.grads, momentum_ > 0 ? at::TensorList(b.slots[0]) : at::TensorList(), weight_decay,
                    momentum_, lr, /*dampening=*/0.0, /*nesterov=*/false, /*maximize=*/false,
                    /*is_first_step=*/false);
  }

  double momentum_;
};

}  // namespace

std::unique_ptr<Optimizer> make_sgd(const std::vector<NamedTensor>& params, const OptimizerOptions& options,
                                    bool momentum) {
  return std::make_unique<Sgd>(params, options, momentum);
}

}  // namespace headroom
