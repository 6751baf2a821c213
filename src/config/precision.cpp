#include "config/precision.h"

#include "util/error.h"

namespace headroom {

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::bf16_mixed: return "bf16-mixed";
    case Precision::fp16_mixed: return "fp16-mixed";
    case Precision::bf16: return "bf16";
    case Precision::bf16_params: return "bf16-params";
  }
  return "?";
}

Precision parse_precision(const std::string& text) {
  for (auto p :
       {Precision::fp32, Precision::bf16_mixed, Precision::fp16_mixed, Precision::bf16, Precision::bf16_params}) {
    if (text == precision_name(p)) return p;
  }
  fail("--precision '{}': accepted: fp32, bf16-mixed, fp16-mixed (with loss scaling), bf16 (pure), bf16-params "
       "(FSDP2's: float32 weights, each layer gathered in bf16 to compute)",
       text);
}

c10::ScalarType parameter_dtype(Precision p) {
  return p == Precision::bf16 ? c10::ScalarType::BFloat16 : c10::ScalarType::Float;
}

c10::ScalarType compute_dtype(Precision p) {
  return p == Precision::bf16_params ? c10::ScalarType::BFloat16 : parameter_dtype(p);
}

}  // namespace headroom
