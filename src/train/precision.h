// Precision at run time (lever 4; the settings themselves are in config/precision.h): the forward
// pass's autocast, and fp16's dynamic loss scaler.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "config/precision.h"
#include "device/autocast_adapter.h"

namespace headroom {

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
  // Unscales `grads` in place; true when any gradient is not finite. `across`, when given, combines
  // this process's verdict with the other ranks' (each holds part of the gradients), and update()
  // follows the combined one.
  bool unscale(const std::vector<at::Tensor>& grads, const std::function<bool(bool)>& across = {});
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
