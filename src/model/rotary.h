// Rotary position embedding (RoPE), as Hugging Face's llama and gpt_neox apply it: the leading
// `rotary_dim` features of each head rotate in pairs (i, i + rotary_dim/2) by position-dependent
// angles; the rest pass through (gpt_neox's partial rotary). Supports llama3 and linear scaling.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "config/model_config.h"

namespace headroom {

class Rotary {
 public:
  explicit Rotary(const ModelConfig& config);

  // cos and sin tables, [T, rotary_dim], float32 on `device`. On cpu they are made for each call
  // (transient, as the estimator models them). On cuda they are made once per (length, device) and
  // kept: making them copies from host memory, a host synchronisation every forward that a CUDA
  // graph capture cannot contain either. Thread-safe.
  std::pair<at::Tensor, at::Tensor> tables(int64_t seq_len, const at::Device& device) const;

  // x: [B, H, T, D]; rotates x[..., :rotary_dim]. Tables come from tables().
  at::Tensor apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const;

  const std::vector<double>& inverse_frequencies() const { return inv_freq_; }

 private:
  int64_t rotary_dim_;
  std::vector<double> inv_freq_;  // rotary_dim / 2 entries
  struct DeviceTables {
    int64_t seq_len;
    at::Device device;
    at::Tensor cos, sin;
  };
  mutable std::mutex device_tables_mutex_;
  mutable std::vector<DeviceTables> device_tables_;  // cuda only
};

}  // namespace headroom
