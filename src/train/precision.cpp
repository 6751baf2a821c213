#include "train/precision.h"

#include <ATen/ATen.h>

#include "util/error.h"

namespace headroom {

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::bf16_mixed: return "bf16-mixed";
    case Precision::fp16_mixed: return "fp16-mixed";
    case Precision::bf16: return "bf16";
  }
  return "?";
}

Precision parse_precision(const std::string& text) {
  for (auto p : {Precision::fp32, Precision::bf16_mixed, Precision::fp16_mixed, Precision::bf16}) {
    if (text == precision_name(p)) return p;
  }
  fail("--precision '{}': accepted: fp32, bf16-mixed, fp16-mixed (with loss scaling), bf16 (pure)", text);
}

c10::ScalarType parameter_dtype(Precision p) { return p == Precision::bf16 ? at::kBFloat16 : at::kFloat; }

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

bool LossScaler::unscale(const std::vector<at::Tensor>& grads) {
  found_inf_.zero_();
  if (!grads.empty()) at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, scale_.reciprocal());
  return found_inf_.item<float>() > 0;
}

void LossScaler::update() { at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, growth_, backoff_, interval_); }

double LossScaler::scale_value() const { return scale_.item<double>(); }

}  // namespace headroom
