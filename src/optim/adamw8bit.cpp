// AdamW with 8-bit states (bitsandbytes' AdamW8bit, blockwise): each parameter of at least 4096
// elements keeps its two moments as one byte per element — indices into the dynamic maps of
// optim/quantize8bit.h, the signed one for the first moment and the unsigned one for the second —
// with a float32 absmax per block of 2048, so the state costs about 2 bytes per parameter instead of
// 8. Smaller parameters keep float32 moments, as bitsandbytes does (its min_8bit_size). The update
// runs block by block in float32: the block's moments are dequantised, updated with the gradient,
// used for the parameter's AdamW step (decoupled weight decay, bias correction) and quantised again
// with the block's new absmax. The loop works in place, on cpu, with no tensor temporaries.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <vector>

#include "optim/optimizers.h"
#include "optim/quantize8bit.h"
#include "util/error.h"

namespace headroom {
namespace {

inline constexpr int64_t kMin8BitSize = 4096;

class AdamW8bit final : public Optimizer {
 public:
  AdamW8bit(const std::vector<NamedTensor>& params, const OptimizerOptions& options) : options_(options) {
    c10::NoGradGuard no_grad;
    for (const auto& p : params) {
      if (p.tensor.is_cuda()) {
        fail("--optimizer adamw8bit runs on cpu in this version; on cuda use bitsandbytes' AdamW8bit from Python, "
             "or --optimizer adamw or adafactor");
      }
      Entry e{p.name, p.tensor, decays(p, options)};
      const int64_t n = p.tensor.numel();
      const auto bytes = p.tensor.options().dtype(at::kByte);
      const auto floats = p.tensor.options().dtype(at::kFloat);
      e.quantised = n >= kMin8BitSize;
      if (e.quantised) {
        const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
        // Index of 0 in each map: a zero moment, whatever its absmax.
        e.m = at::full({n}, zero_code(true), bytes);
        e.v = at::full({n}, zero_code(false), bytes);
        e.m_absmax = at::zeros({blocks}, floats);
        e.v_absmax = at::zeros({blocks}, floats);
      } else {
        e.m = at::zeros({n}, floats);
        e.v = at::zeros({n}, floats);
      }
      e.step = at::zeros({}, floats);
      entries_.push_back(std::move(e));
    }
  }

  std::string name() const override { return "adamw8bit"; }

  std::vector<NamedTensor> state() const override {
    std::vector<NamedTensor> out;
    for (const Entry& e : entries_) {
      if (e.quantised) {
        out.push_back({e.name + ".state1", e.m});
        out.push_back({e.name + ".absmax1", e.m_absmax});
        out.push_back({e.name + ".state2", e.v});
        out.push_back({e.name + ".absmax2", e.v_absmax});
      } else {
        out.push_back({e.name + ".exp_avg", e.m});
        out.push_back({e.name + ".exp_avg_sq", e.v});
      }
      out.push_back({e.name + ".step", e.step});
    }
    return out;
  }

  void step(double lr) override {
    c10::NoGradGuard no_grad;
    for (Entry& e : entries_) {
      const at::Tensor grad = e.param.grad();
      if (!grad.defined()) continue;
      TORCH_CHECK(e.param.is_contiguous() && grad.is_contiguous(), "adamw8bit: parameters must be contiguous");
      if (e.steps < 0) e.steps = static_cast<int64_t>(e.step.item<double>());
      e.step.fill_(static_cast<double>(++e.steps));
      const double wd = e.decays ? options_.weight_decay : 0.0;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, e.param.scalar_type(), "adamw8bit", [&] {
        update<scalar_t>(e, grad, lr, wd);
      });
    }
  }

 private:
  struct Entry {
    std::string name;
    at::Tensor param;
    bool decays = false;
    bool quantised = false;
    at::Tensor m, v;                // uint8 codes (quantised) or float32 moments
    at::Tensor m_absmax, v_absmax;  // float32, one per block (quantised)
    at::Tensor step;
    int64_t steps = -1;  // host copy of the step counter; -1: not read yet
  };

  static uint8_t zero_code(bool is_signed) { return quantize_nearest(dynamic_map(is_signed), 0.0F); }

  template <typename T>
  void update(Entry& e, const at::Tensor& grad, double lr, double wd) {
    const double b1 = options_.beta1, b2 = options_.beta2, eps = options_.eps;
    const double bc1 = 1 - std::pow(b1, static_cast<double>(e.steps));
    const double bc2 = 1 - std::pow(b2, static_cast<double>(e.steps));
    const auto step_size = static_cast<float>(lr / bc1);
    const auto root_bc2 = static_cast<float>(std::sqrt(bc2));
    const auto decay = static_cast<float>(1 - lr * wd);
    const int64_t n = e.param.numel();
    T* p = e.param.data_ptr<T>();
    const T* g = grad.data_ptr<T>();
    const auto fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2), feps = static_cast<float>(eps);
    // One element: the moments updated, the parameter stepped.
    auto advance = [&](int64_t i, float& m, float& v) {
      const auto gi = static_cast<float>(g[i]);
      m = fb1 * m + (1 - fb1) * gi;
      v = fb2 * v + (1 - fb2) * gi * gi;
      const float denom = std::sqrt(v) / root_bc2 + feps;
      p[i] = static_cast<T>(static_cast<float>(p[i]) * decay - step_size * m / denom);
    };
    if (!e.quantised) {
      float* m = e.m.data_ptr<float>();
      float* v = e.v.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) advance(i, m[i], v[i]);
      return;
    }
    const auto& map1 = dynamic_map(true);
    const auto& map2 = dynamic_map(false);
    uint8_t* q1 = e.m.data_ptr<uint8_t>();
    uint8_t* q2 = e.v.data_ptr<uint8_t>();
    float* a1 = e.m_absmax.data_ptr<float>();
    float* a2 = e.v_absmax.data_ptr<float>();
    const int64_t blocks = e.m_absmax.numel();
    // Blocks are independent: each thread takes whole blocks, so the result does not depend on the
    // thread count.
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      std::vector<float> m(kQuantBlock), v(kQuantBlock);
      for (int64_t b = first; b < last; ++b) {
        const int64_t begin = b * kQuantBlock, size = std::min(kQuantBlock, n - begin);
        float max_m = 0, max_v = 0;
        for (int64_t j = 0; j < size; ++j) {
          m[j] = map1[q1[begin + j]] * a1[b];
          v[j] = map2[q2[begin + j]] * a2[b];
          advance(begin + j, m[j], v[j]);
          max_m = std::max(max_m, std::abs(m[j]));
          max_v = std::max(max_v, v[j]);
        }
        a1[b] = max_m;
        a2[b] = max_v;
        for (int64_t j = 0; j < size; ++j) {
          q1[begin + j] = quantize_nearest(map1, max_m > 0 ? m[j] / max_m : 0.0F);
          q2[begin + j] = quantize_nearest(map2, max_v > 0 ? v[j] / max_v : 0.0F);
        }
      }
    });
  }

  OptimizerOptions options_;
  std::vector<Entry> entries_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adamw8bit(const std::vector<NamedTensor>& params, const OptimizerOptions& options) {
  return std::make_unique<AdamW8bit>(params, options);
}

}  // namespace headroom
