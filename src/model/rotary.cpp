#include "model/rotary.h"

#include <ATen/ATen.h>

#include <cmath>
#include <numbers>

namespace headroom {

Rotary::Rotary(const ModelConfig& c) : rotary_dim_(c.rotary_dim) {
  const int64_t half = rotary_dim_ / 2;
  inv_freq_.resize(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    inv_freq_[i] = 1.0 / std::pow(c.rope_theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim_));
  }
  if (!c.rope_scaling) return;
  const RopeScaling& s = *c.rope_scaling;
  if (s.type == "linear") {
    for (double& f : inv_freq_) f /= s.factor;
    return;
  }
  // llama3: long wavelengths slow down by `factor`, short ones stay, the band between blends.
  const double old_len = static_cast<double>(s.original_max_positions);
  const double low_wavelen = old_len / s.low_freq_factor;
  const double high_wavelen = old_len / s.high_freq_factor;
  for (double& f : inv_freq_) {
    const double wavelen = 2 * std::numbers::pi / f;
    if (wavelen < high_wavelen) continue;
    if (wavelen > low_wavelen) {
      f /= s.factor;
      continue;
    }
    const double smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    f = (1 - smooth) * f / s.factor + smooth * f;
  }
}

std::pair<at::Tensor, at::Tensor> Rotary::tables(int64_t seq_len, const at::Device& device) const {
  auto make = [&]() -> std::pair<at::Tensor, at::Tensor> {
    auto f32 = at::TensorOptions().dtype(at::kFloat);
    auto inv = at::tensor(std::vector<float>(inv_freq_.begin(), inv_freq_.end()), f32);
    auto pos = at::arange(seq_len, f32);
    auto freqs = at::outer(pos, inv);
    auto emb = at::cat({freqs, freqs}, -1);
    return {emb.cos().to(device), emb.sin().to(device)};
  };
  if (!device.is_cuda()) return make();
  const std::lock_guard<std::mutex> lock(device_tables_mutex_);
  for (const DeviceTables& t : device_tables_) {
    if (t.seq_len == seq_len && t.device == device) return {t.cos, t.sin};
  }
  auto [cos, sin] = make();
  device_tables_.push_back({seq_len, device, cos, sin});
  return {cos, sin};
}

at::Tensor Rotary::apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
  const int64_t d = x.size(-1);
  at::Tensor rot = rotary_dim_ == d ? x : x.narrow(-1, 0, rotary_dim_);
  const int64_t half = rotary_dim_ / 2;
  auto rotated_half = at::cat({-rot.narrow(-1, half, half), rot.narrow(-1, 0, half)}, -1);
  auto c = cos.to(x.scalar_type());
  auto s = sin.to(x.scalar_type());
  auto out = rot * c + rotated_half * s;
  if (rotary_dim_ == d) return out;
  return at::cat({out, x.narrow(-1, rotary_dim_, d - rotary_dim_)}, -1);
}

}  // namespace headroom
