// Adagrad through ATen's fused kernel (_fused_adagrad_): in place, no per-parameter temporaries.
// PyTorch's defaults: eps 1e-10, no learning-rate decay, accumulators start at zero.
#include <ATen/ATen.h>

#include "optim/optimizers.h"

namespace headroom {
namespace {

class Adagrad final : public FusedOptimizer {
 public:
  Adagrad(const std::vector<NamedTensor>& params, const OptimizerOptions& options)
      : FusedOptimizer(params, {"sum", "step"}, /*step_slot=*/1,
                       [](const at::Tensor& p) {
                         return std::vector<at::Tensor>{at::zeros_like(p, at::MemoryFormat::Contiguous),
                                                        at::zeros({}, p.options().dtype(at::kFloat))};
                       },
                       options) {}

  std::string name() const override { return "adagrad"; }

 private:
  void update(Batch& b, double lr, double weight_decay) override {
    at::_fused_adagrad_(b.params, b.grads, b.slots[0], b.slots[1], lr, /*lr_decay=*/0.0, weight_decay,
                        /*eps=*/1e-10, /*maximize=*/false);
  }
};

}  // namespace

std::unique_ptr<Optimizer> make_adagrad(const std::vector<NamedTensor>& params, const OptimizerOptions& options) {
  return std::make_unique<Adagrad>(params, options);
}

}  // namespace headroom
