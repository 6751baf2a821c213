// Precision — how a run computes (lever 4):
//   fp32        everything in float32
//   bf16-mixed  float32 weights, gradients and optimizer state; the forward pass under autocast to
//               bfloat16 (autocast caches low-precision copies of the weights during it)
//   fp16-mixed  the same with float16, plus a dynamic loss scaler (LossScaler)
//   bf16        weights, gradients and optimizer state in bfloat16 ("pure" bf16)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "device/autocast_adapter.h"

namespace headroom {

enum class Precision { fp32, bf16_mixed, fp16_mixed, bf16 };

const char* precision_name(Precision p);
// Throws Error naming the accepted values.
Precision parse_precision(const std::string& text);

// dtype of the weights, gradients and optimizer state.
c10::ScalarType parameter_dtype(Precision p);
// The autocast setting of the forward pass.
AutocastState forward_autocast(Precision p);

// Dynamic loss scaling for fp16, as torch.amp.GradScaler does it, on ATen's amp kernels: the loss
// is multiplied by the scale before backward; unscale() divides the gradients by it and reports
// whether any is inf or NaN (the step must then be skipped); update() halves the scale after an
// overflow and doubles it after `interval` steps without one.
class LossScaler {
 public:
  LossScaler(const c10::Device& device, double initial_scale = 65536.0, double growth = 2.0, double backoff = 0.5,
             int64_t interval = 2000);

  at::Tensor scale(const at::Tensor& loss) const { return loss * scale_; }
  // Unscales `grads` in place; true when any gradient is not finite.
  bool unscale(const std::vector<at::Tensor>& grads);
  void update();
  double scale_value() const;

 private:
  at::Tensor scale_;           // float32 scalar
  at::Tensor growth_tracker_;  // int32 scalar: steps since the last overflow
  at::Tensor found_inf_;       // float32 scalar
  double growth_, backoff_;
  int64_t interval_;
};

}  // namespace headroom
