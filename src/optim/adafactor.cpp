// Adafactor (Shazeer & Stern, 2018) as PyTorch's torch.optim.Adafactor computes it: the second
// moment of a matrix is factored into row and column running means (n + m numbers instead of n * m);
// vectors keep a full second moment; no first moment. Relative step size rho_t = min(lr, 1/sqrt(t))
// scaled by the parameter's RMS (at least eps2), beta2_t = 1 - t^beta2_decay, update RMS clipped to
// d, decoupled weight decay. ATen has no fused form, so one scratch buffer the size of the largest
// parameter is allocated up front and each step works in it: no parameter-sized temporaries.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>

#include "optim/optimizers.h"

namespace headroom {
namespace {

class Adafactor final : public Optimizer {
 public:
  Adafactor(const std::vector<NamedTensor>& params, const OptimizerOptions& options) : options_(options) {
    c10::NoGradGuard no_grad;
    int64_t largest = 0;
    for (const auto& p : params) {
      TORCH_CHECK(p.tensor.dim() <= 2, "Adafactor: parameters of more than two dimensions are not supported");
      Slot s;
      s.name = p.name;
      s.param = p.tensor;
      auto f32 = p.tensor.options().dtype(at::kFloat);
      if (p.tensor.dim() == 2) {
        s.row_var = at::zeros({p.tensor.size(0), 1}, f32);
        s.col_var = at::zeros({1, p.tensor.size(1)}, f32);
      } else {
        s.variance = at::zeros_like(p.tensor, f32);
      }
      s.step = at::zeros({}, f32);
      largest = std::max(largest, p.tensor.numel());
      slots_.push_back(std::move(s));
    }
    if (!params.empty()) scratch_ = at::empty({largest}, params[0].tensor.options().dtype(at::kFloat));
  }

  void step(double lr) override {
    c10::NoGradGuard no_grad;
    for (Slot& s : slots_) {
      // PyTorch's eps1 default: the machine epsilon of the parameter's dtype.
      const double eps1 = s.param.scalar_type() == at::kBFloat16 ? 0.0078125
                          : s.param.scalar_type() == at::kHalf   ? 0.0009765625
                                                                 : std::numeric_limits<float>::epsilon();
      const at::Tensor& g = s.param.grad();
      if (!g.defined()) continue;
      const double t = s.step.item<double>() + 1.0;
      s.step.fill_(t);  // not add_(1.0), which would allocate a scalar tensor
      // beta2_t = 1 - t^decay; moments move towards the new estimate by 1 - beta2_t = t^decay.
      const double weight = std::pow(t, options_.beta2_decay);
      const double rho = std::min(lr, 1.0 / std::sqrt(t));
      const double numel = static_cast<double>(s.param.numel());
      const double alpha = std::max(options_.adafactor_eps2, s.param.norm().item<double>() / std::sqrt(numel)) * rho;
      if (options_.weight_decay != 0 && decays(s.param)) s.param.mul_(1.0 - lr * options_.weight_decay);
      at::Tensor var = scratch_.narrow(0, 0, s.param.numel()).view(s.param.sizes());
      if (s.param.dim() == 2) {
        // Moments in float32 whatever the gradient's dtype (pure bf16 runs).
        s.row_var.lerp_(g.norm(2, {-1}, true, at::kFloat).square_().div_(g.size(-1)), weight);
        s.col_var.lerp_(g.norm(2, {-2}, true, at::kFloat).square_().div_(g.size(-2)), weight);
        at::matmul_out(var, s.row_var, s.col_var);
        var.div_(s.row_var.mean({-2}, true).clamp_min_(eps1));
      } else {
        at::mul_out(var, g, g);
        s.variance.lerp_(var, weight);
        var.copy_(s.variance);
      }
      at::Tensor& update = var.clamp_min_(eps1 * eps1).rsqrt_().mul_(g);
      const double denom =
          std::max(1.0, update.norm().item<double>() / (std::sqrt(numel) * options_.adafactor_clip));
      s.param.add_(update, -alpha / denom);
    }
  }

  std::vector<NamedTensor> state() const override {
    std::vector<NamedTensor> out;
    for (const Slot& s : slots_) {
      if (s.row_var.defined()) {
        out.push_back({s.name + ".row_var", s.row_var});
        out.push_back({s.name + ".col_var", s.col_var});
      } else {
        out.push_back({s.name + ".variance", s.variance});
      }
      out.push_back({s.name + ".step", s.step});
    }
    return out;
  }

  std::string name() const override { return "adafactor"; }

  // The scratch buffer is working memory, not state: held, but not checkpointed.
  std::vector<at::Tensor> working_memory() const override { return {scratch_}; }

 private:
  struct Slot {
    std::string name;
    at::Tensor param, row_var, col_var, variance, step;
  };

  OptimizerOptions options_;
  std::vector<Slot> slots_;
  at::Tensor scratch_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adafactor(const std::vector<NamedTensor>& params, const OptimizerOptions& options) {
  return std::make_unique<Adafactor>(params, options);
}

}  // namespace headroom
