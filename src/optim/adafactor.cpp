// Adafactor (Shazeer & Stern, 2018) as PyTorch's torch.optim.Adafactor computes it: the second
// moment of a matrix is factored into row and column running means (n + m numbers instead of n * m);
// vectors keep a full second moment; no first moment. Relative step size rho_t = min(lr, 1/sqrt(t))
// scaled by the parameter's RMS (at least eps2), beta2_t = 1 - t^beta2_decay, update RMS clipped to
// d, decoupled weight decay.
//
// Sharded (OptimizerOptions::sharding), a rank updates a 1-D slice of each parameter, which may start
// and end inside a row. What the update needs of the whole matrix is few numbers: the sums of the
// squared gradient over each row and each column, the parameter's squared norm and the update's. A
// step sums each rank's part of them over the ranks (two collectives per step, over all parameters
// at once), so every rank keeps the same whole row and column moments and updates its slice exactly
// as one process would update the matrix.
//
// ATen has no fused form: one float32 scratch buffer, big enough for the rows any part touches, and
// the statistics' buffers are allocated up front, and each step works in them.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>

#include "optim/optimizers.h"
#include "util/error.h"

namespace headroom {
namespace {

class Adafactor final : public Optimizer {
 public:
  Adafactor(const std::vector<NamedTensor>& params, const OptimizerOptions& options) : options_(options) {
    c10::NoGradGuard no_grad;
    if (options.sharding) {
      // Its buffers must live where the other ranks' do (the sums run on the device's backend).
      TORCH_CHECK(!params.empty(), "Adafactor: a sharded rank must own part of some parameter");
      size_t matched = 0;
      for (const ParameterSlice& ps : options.sharding->parameters) {
        Slot s;
        s.name = ps.name;
        s.sizes = ps.sizes;
        s.start = ps.start;
        s.length = ps.length;
        for (const auto& p : params) {
          if (p.name == ps.name) {
            s.param = p.tensor;
            ++matched;
          }
        }
        TORCH_CHECK(s.length == 0 || (s.param.defined() && s.param.numel() == s.length), "Adafactor: no slice of ",
                    ps.length, " elements given for ", ps.name);
        slots_.push_back(std::move(s));
      }
      TORCH_CHECK(matched == params.size(), "Adafactor: a tensor to update is no parameter of the sharding");
    } else {
      for (const auto& p : params) {
        Slot s;
        s.name = p.name;
        s.sizes = p.tensor.sizes().vec();
        s.length = p.tensor.numel();
        s.param = p.tensor;
        slots_.push_back(std::move(s));
      }
    }
    int64_t largest = 0, statistics = 0;
    for (Slot& s : slots_) {
      TORCH_CHECK(s.sizes.size() <= 2, "Adafactor: parameters of more than two dimensions are not supported");
      s.matrix = s.sizes.size() == 2;
      s.numel = 1;
      for (int64_t d : s.sizes) s.numel *= d;
      if (s.matrix) {
        s.statistics = statistics;
        statistics += s.sizes[0] + s.sizes[1];
      }
      if (s.length == 0) continue;  // nothing of it on this rank: no state, zeros in the sums
      auto f32 = s.param.options().dtype(at::kFloat);
      if (s.matrix) {
        s.row_var = at::zeros({s.sizes[0], 1}, f32);
        s.col_var = at::zeros({1, s.sizes[1]}, f32);
      } else {
        s.variance = at::zeros({s.length}, f32);
      }
      s.step = at::zeros({}, f32);
      largest = std::max(largest, s.region());
    }
    at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
    for (const auto& p : params) f32 = f32.device(p.tensor.device());
    scratch_ = at::empty({largest}, f32);
    statistics_ = at::empty({statistics}, f32);
    norms_ = at::empty({2, static_cast<int64_t>(slots_.size())}, f32);
  }

  void step(double lr) override {
    c10::NoGradGuard no_grad;
    // Each part's sums of squares: the gradient's over every row and column (matrices; a vector's
    // own second moment needs no one else's), and the parameter's.
    statistics_.zero_();
    norms_.zero_();
    for (size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      if (!updates(s)) continue;
      s.steps = static_cast<int64_t>(s.step.item<double>()) + 1;
      at::Tensor part = s.part_of(scratch_);
      part.view(s.param.sizes()).copy_(s.param);
      part.mul_(part);
      at::Tensor squares = norms_[0][static_cast<int64_t>(i)];
      at::sum_out(squares, part, {0});
      if (s.matrix) s.region_of(scratch_).zero_();  // the touched rows' elements outside the part add nothing
      part.view(s.param.sizes()).copy_(s.param.grad());
      part.mul_(part);
      if (s.matrix) {
        const at::Tensor rows = s.region_of(scratch_).view({-1, s.sizes[1]});
        at::Tensor row_sums = statistics_.narrow(0, s.statistics + s.first_row(), rows.size(0));
        at::Tensor col_sums = statistics_.narrow(0, s.statistics + s.sizes[0], s.sizes[1]);
        at::sum_out(row_sums, rows, {1});
        at::sum_out(col_sums, rows, {0});
      } else {
        s.variance.lerp_(part, weight(s));
      }
    }
    if (options_.sharding) options_.sharding->sum(statistics_);
    for (Slot& s : slots_) {
      if (!updates(s)) continue;
      if (s.matrix) {
        // Moments in float32 whatever the gradient's dtype (pure bf16 runs): the means of the squares.
        const double w = weight(s);
        s.row_var.lerp_(statistics_.narrow(0, s.statistics, s.sizes[0]).div_(s.sizes[1]).view({-1, 1}), w);
        s.col_var.lerp_(statistics_.narrow(0, s.statistics + s.sizes[0], s.sizes[1]).div_(s.sizes[0]).view({1, -1}), w);
        s.row_mean = std::max(eps1(s), s.row_var.mean().item<double>());
      }
      s.step.fill_(static_cast<double>(s.steps));  // not add_(1.0), which would allocate a scalar tensor
    }
    // The update's norm over the whole parameter clips it: sharded, it is computed once for the sums
    // and again to be applied; alone, applied at once.
    for (size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      if (!updates(s)) continue;
      const at::Tensor update = compute_update(s);
      at::Tensor norm = norms_[1][static_cast<int64_t>(i)];
      at::linalg_vector_norm_out(norm, update, 2);
      norm.square_();
      if (!options_.sharding)
        apply(s, update, lr, norms_[0][static_cast<int64_t>(i)].item<double>(), norm.item<double>());
    }
    if (!options_.sharding) return;
    options_.sharding->sum(norms_);
    for (size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      if (!updates(s)) continue;
      apply(s, compute_update(s), lr, norms_[0][static_cast<int64_t>(i)].item<double>(),
            norms_[1][static_cast<int64_t>(i)].item<double>());
    }
  }

  std::vector<NamedTensor> state() const override {
    std::vector<NamedTensor> out;
    for (const Slot& s : slots_) {
      if (s.length == 0) continue;
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

  // The scratch and statistics buffers are working memory, not state: held, but not checkpointed.
  std::vector<at::Tensor> working_memory() const override { return {scratch_, statistics_, norms_}; }

  bool whole_parameter_state(const std::string& name) const override {
    auto ends_with = [&](const std::string& suffix) {
      return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    return ends_with(".row_var") || ends_with(".col_var");
  }

 private:
  struct Slot {
    std::string name;
    std::vector<int64_t> sizes;     // the whole parameter's
    int64_t start = 0, length = 0;  // the part updated here, of the flattened parameter
    at::Tensor param;               // the part: the parameter, or its 1-D slice
    at::Tensor row_var, col_var, variance, step;
    bool matrix = false;
    int64_t numel = 0;
    int64_t statistics = 0;  // a matrix's rows' then columns' sums in statistics_
    int64_t steps = 0;       // this step's t: `step` + 1 (read each step: a checkpoint may have loaded it)
    double row_mean = 0;     // this step's mean of row_var (clamped to eps1)

    // A matrix's part, in the scratch buffer, lies inside the whole rows it touches (the region);
    // a vector's is the region.
    int64_t first_row() const { return matrix ? start / sizes[1] : 0; }
    int64_t region() const { return matrix ? ((start + length - 1) / sizes[1] - first_row() + 1) * sizes[1] : length; }
    at::Tensor region_of(const at::Tensor& scratch) const { return scratch.narrow(0, 0, region()); }
    at::Tensor part_of(const at::Tensor& scratch) const {
      return scratch.narrow(0, matrix ? start - first_row() * sizes[1] : 0, length);
    }
  };

  // Whether the part is updated this step (alone, a parameter without a gradient is skipped).
  static bool updates(const Slot& s) { return s.length > 0 && s.param.grad().defined(); }

  static double eps1(const Slot& s) {
    // PyTorch's eps1 default: the machine epsilon of the parameter's dtype.
    return s.param.scalar_type() == at::kBFloat16 ? 0.0078125
           : s.param.scalar_type() == at::kHalf   ? 0.0009765625
                                                  : std::numeric_limits<float>::epsilon();
  }

  // 1 - beta2_t = t^decay: how far the moments move towards this step's estimate.
  double weight(const Slot& s) const { return std::pow(static_cast<double>(s.steps), options_.beta2_decay); }

  // The update of the part, before its scaling: g / sqrt(v), v the second moment (factored for a
  // matrix: R C / mean(R)); in the scratch buffer, shaped as the part.
  at::Tensor compute_update(const Slot& s) {
    const double e = eps1(s);
    at::Tensor part = s.part_of(scratch_);
    if (s.matrix) {
      at::Tensor region = s.region_of(scratch_).view({-1, s.sizes[1]});
      at::mul_out(region, s.row_var.narrow(0, s.first_row(), region.size(0)), s.col_var);
      part.div_(s.row_mean);
    } else {
      part.copy_(s.variance);
    }
    return part.clamp_min_(e * e).rsqrt_().view(s.param.sizes()).mul_(s.param.grad());
  }

  // The part's step, from the whole parameter's squared norm and the whole update's.
  void apply(Slot& s, const at::Tensor& update, double lr, double param_squares, double update_squares) {
    const double rho = std::min(lr, 1.0 / std::sqrt(static_cast<double>(s.steps)));
    const double numel = static_cast<double>(s.numel);
    const double alpha = std::max(options_.adafactor_eps2, std::sqrt(param_squares / numel)) * rho;
    const double denom = std::max(1.0, std::sqrt(update_squares / numel) / options_.adafactor_clip);
    if (options_.weight_decay != 0 && s.matrix) s.param.mul_(1.0 - lr * options_.weight_decay);
    s.param.add_(update, -alpha / denom);
  }

  OptimizerOptions options_;
  std::vector<Slot> slots_;
  at::Tensor scratch_;
  at::Tensor statistics_;  // per matrix: its rows' sums of squared gradients, then its columns'
  at::Tensor norms_;       // per parameter: [0] its squared norm, [1] its update's
};

}  // namespace

std::unique_ptr<Optimizer> make_adafactor(const std::vector<NamedTensor>& params, const OptimizerOptions& options) {
  return std::make_unique<Adafactor>(params, options);
}

}  // namespace headroom
