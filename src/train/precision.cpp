#include "train/precision.h"

#include <ATen/ATen.h>

#include "util/error.h"

namespace headroom {

AutocastState forward_autocast(Precision p) {
  switch (p) {
    case Precision::bf16_mixed: return {true, at::kBFloat16};
    case Precision::fp16_mixed: return {true, at::kHalf};
    default: return {false, at::kBFloat16};
  }
}

LossScaler::LossScaler(const c10::Device& device, double initial_scale, double growth, double backoff, int64_t interval)
    : scale_(at::full({}, initial_scale, at::TensorOptions().dtype(at::kFloat).device(device))),
      growth_tracker_(at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device))),
      found_inf_(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device))),
      growth_(growth),
      backoff_(backoff),
      interval_(interval) {}

bool LossScaler::unscale(const std::vector<at::Tensor>& grads, const std::function<bool(bool)>& across) {
  found_inf_.zero_();
  if (!grads.empty()) at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, scale_.reciprocal());
  const bool found = found_inf_.item<float>() > 0;
  if (!across) return found;
  const bool anywhere = across(found);
  found_inf_.fill_(anywhere ? 1.0 : 0.0);
  return anywhere;
}

void LossScaler::update() { at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, growth_, backoff_, interval_); }

double LossScaler::scale_value() const { return scale_.item<double>(); }

}  // namespace headroom
