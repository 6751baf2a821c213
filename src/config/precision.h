// Precision — how a run computes (lever 4):
//   fp32        everything in float32
//   bf16-mixed  float32 weights, gradients and optimizer state; the forward pass under autocast to
//               bfloat16 (autocast caches low-precision copies of the weights during it)
//   fp16-mixed  the same with float16, plus a dynamic loss scaler (train/precision.h)
//   bf16        weights, gradients and optimizer state in bfloat16 ("pure" bf16)
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace headroom {

enum class Precision { fp32, bf16_mixed, fp16_mixed, bf16 };

const char* precision_name(Precision p);
// Throws Error naming the accepted values.
Precision parse_precision(const std::string& text);

// dtype of the weights, gradients and optimizer state.
c10::ScalarType parameter_dtype(Precision p);

}  // namespace headroom
