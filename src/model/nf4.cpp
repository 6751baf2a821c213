#include "model/nf4.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>

#include "device/autocast_adapter.h"

namespace headroom {
namespace {

// The standard normal's quantile function: Newton's method on its distribution function.
double normal_quantile(double p) {
  double x = 0;
  for (int i = 0; i < 100; ++i) {
    const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
    const double step = (cdf - p) / pdf;
    x -= step;
    if (std::abs(step) < 1e-15) break;
  }
  return x;
}

std::array<float, 16> make_code() {
  // QLoRA's create_normal_map(offset=0.9677083, use_extra_value=True): 8 positive quantiles from
  // linspace(offset, 0.5, 9) without its last, 7 negative ones from linspace(offset, 0.5, 8)
  // without its last, and zero; divided by the largest.
  constexpr double offset = 0.9677083;
  const double top = normal_quantile(offset);
  std::array<float, 16> code{};
  for (int i = 0; i < 7; ++i) {
    const double p = offset + (0.5 - offset) * i / 7.0;
    code[static_cast<size_t>(i)] = static_cast<float>(-normal_quantile(p) / top);
  }
  code[7] = 0.0F;
  for (int i = 0; i < 8; ++i) {
    const double p = offset + (0.5 - offset) * i / 8.0;
    code[static_cast<size_t>(15 - i)] = static_cast<float>(normal_quantile(p) / top);
  }
  return code;
}

// The index of the code value nearest to x (in [-1, 1]): between neighbours, by their midpoint.
uint8_t nearest(const std::array<float, 16>& code, float x) {
  uint8_t i = 0;
  while (i < 15 && x > 0.5F * (code[i] + code[i + 1U])) ++i;
  return i;
}

template <typename T>
void quantise_cpu(const T* in, int64_t n, uint8_t* codes, float* absmax) {
  const auto& code = nf4_code();
  const int64_t blocks = nf4_blocks(n);
  at::parallel_for(0, blocks, 16, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * kNf4Block, end = std::min(n, begin + kNf4Block);
      float m = 0;
      for (int64_t i = begin; i < end; ++i) m = std::max(m, std::abs(static_cast<float>(in[i])));
      absmax[b] = m;
      const float scale = m > 0 ? 1.0F / m : 0.0F;
      for (int64_t i = begin; i < end; i += 2) {
        const uint8_t hi = nearest(code, static_cast<float>(in[i]) * scale);
        const uint8_t lo = i + 1 < end ? nearest(code, static_cast<float>(in[i + 1]) * scale) : 0;
        codes[i / 2] = static_cast<uint8_t>((hi << 4) | lo);
      }
    }
  });
}

template <typename T>
void dequantise_cpu(const uint8_t* codes, const float* absmax, int64_t n, T* out) {
  const auto& code = nf4_code();
  at::parallel_for(0, nf4_blocks(n), 16, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * kNf4Block, end = std::min(n, begin + kNf4Block);
      for (int64_t i = begin; i < end; ++i) {
        const uint8_t byte = codes[i / 2];
        out[i] = static_cast<T>(code[i % 2 == 0 ? byte >> 4 : byte & 15] * absmax[b]);
      }
    }
  });
}

at::Tensor code_table(const at::TensorOptions& options) {
  const auto& code = nf4_code();
  return at::tensor(std::vector<float>(code.begin(), code.end()), options.dtype(at::kFloat));
}

// Elsewhere than the cpu: the same with tensor operations (temporaries of the weight's size).
void quantise_tensors(const at::Tensor& dense, Nf4Weight& w) {
  const int64_t n = dense.numel(), blocks = nf4_blocks(n);
  at::Tensor x = at::constant_pad_nd(dense.reshape(-1).to(at::kFloat), {0, blocks * kNf4Block - n});
  x = x.view({blocks, kNf4Block});
  const at::Tensor m = x.abs().amax(1);
  w.absmax.copy_(m);
  const at::Tensor scaled = x / m.clamp_min(1e-30).unsqueeze(1) * (m > 0).unsqueeze(1);
  const at::Tensor table = code_table(dense.options());
  const at::Tensor midpoints = (table.narrow(0, 0, 15) + table.narrow(0, 1, 15)) / 2;
  at::Tensor index = at::bucketize(scaled.reshape(-1), midpoints, /*out_int32=*/false, /*right=*/false)
                         .to(at::kByte)
                         .narrow(0, 0, 2 * w.codes.numel());
  if (index.numel() % 2 != 0) index = at::constant_pad_nd(index, {0, 1});
  const at::Tensor pairs = index.view({-1, 2});
  w.codes.copy_(pairs.select(1, 0).bitwise_left_shift(4).bitwise_or(pairs.select(1, 1)));
}

at::Tensor dequantise_tensors(const Nf4Weight& w, c10::ScalarType dtype) {
  const int64_t n = w.numel();
  const at::Tensor hi = w.codes.bitwise_right_shift(4), lo = w.codes.bitwise_and(15);
  const at::Tensor index = at::stack({hi, lo}, 1).reshape(-1).narrow(0, 0, n).to(at::kLong);
  const at::Tensor values = code_table(w.codes.options()).index_select(0, index);
  const at::Tensor scale = w.absmax.repeat_interleave(kNf4Block).narrow(0, 0, n);
  return (values * scale).to(dtype).view(w.sizes);
}

c10::ScalarType compute_dtype(const at::Tensor& x, const Nf4Weight& w) {
  const AutocastState autocast = autocast_state(x.device().type());
  return autocast.enabled ? autocast.dtype : w.dtype;
}

// The frozen operands, passed to the function as one value that autograd does not track.
struct Frozen {
  const Nf4Weight* weight;
  const at::Tensor* bias;
};

// The linear layer over an NF4 weight: nothing saved but the weight's own (frozen) tensors.
struct Nf4Linear : public torch::autograd::Function<Nf4Linear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, Frozen frozen) {
    const Nf4Weight& w = *frozen.weight;
    const c10::ScalarType compute = compute_dtype(x, w);
    ctx->saved_data["codes"] = w.codes;
    ctx->saved_data["absmax"] = w.absmax;
    ctx->saved_data["sizes"] = w.sizes;
    ctx->saved_data["compute"] = static_cast<int64_t>(compute);
    at::Tensor dense = nf4_dequantise(w, compute);
    return at::linear(x, dense, *frozen.bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    Nf4Weight w{ctx->saved_data["codes"].toTensor(), ctx->saved_data["absmax"].toTensor(),
                ctx->saved_data["sizes"].toIntVector()};
    const auto compute = static_cast<c10::ScalarType>(ctx->saved_data["compute"].toInt());
    at::Tensor dense = nf4_dequantise(w, compute);
    at::Tensor grad_x = at::matmul(grads[0].to(compute), dense);
    return {grad_x, at::Tensor()};
  }
};

}  // namespace

const std::array<float, 16>& nf4_code() {
  static const std::array<float, 16> code = make_code();
  return code;
}

int64_t Nf4Weight::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

std::string nf4_codes_name(const std::string& weight) { return weight + ".nf4"; }
std::string nf4_absmax_name(const std::string& weight) { return weight + ".absmax"; }
std::string nf4_weight_of_codes(const std::string& param) {
  return ends_with(param, ".nf4") ? param.substr(0, param.size() - 4) : "";
}
bool is_nf4_part(const std::string& param) { return ends_with(param, ".nf4") || ends_with(param, ".absmax"); }

int64_t nf4_code_bytes(int64_t numel) { return (numel + 1) / 2; }
int64_t nf4_blocks(int64_t numel) { return (numel + kNf4Block - 1) / kNf4Block; }

void nf4_quantise_into(const at::Tensor& dense, Nf4Weight& w) {
  c10::NoGradGuard no_grad;
  TORCH_CHECK(dense.numel() == w.numel(), "nf4: a weight of ", dense.numel(), " values for ", w.numel());
  if (w.codes.is_meta()) return;
  if (!dense.is_cpu()) {
    quantise_tensors(dense, w);
    return;
  }
  const at::Tensor in = dense.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "nf4_quantise", [&] {
    quantise_cpu<scalar_t>(in.data_ptr<scalar_t>(), in.numel(), w.codes.data_ptr<uint8_t>(),
                           w.absmax.data_ptr<float>());
  });
}

at::Tensor nf4_dequantise(const Nf4Weight& w, c10::ScalarType dtype) {
  c10::NoGradGuard no_grad;
  if (w.codes.is_meta()) return at::empty(w.sizes, w.codes.options().dtype(dtype));
  if (!w.codes.is_cpu()) return dequantise_tensors(w, dtype);
  at::Tensor out = at::empty(w.sizes, w.codes.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "nf4_dequantise", [&] {
    dequantise_cpu<scalar_t>(w.codes.data_ptr<uint8_t>(), w.absmax.data_ptr<float>(), w.numel(),
                             out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor nf4_linear(const at::Tensor& x, const Nf4Weight& w, const at::Tensor& bias) {
  return Nf4Linear::apply(x, Frozen{&w, &bias});
}

}  // namespace headroom
