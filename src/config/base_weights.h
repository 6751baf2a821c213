// BaseWeights — how a fine-tune holds its frozen base's projections: dense in the run's dtype, or
// in 4-bit NF4 (QLoRA; model/nf4.h), dequantised a layer at a time on use. Parsed once from
// --base-weights.
#pragma once

#include <string>

namespace headroom {

enum class BaseWeights { dense, nf4 };

inline constexpr BaseWeights kBaseWeights[] = {BaseWeights::dense, BaseWeights::nf4};

const char* base_weights_name(BaseWeights b);
// Throws Error naming the accepted values.
BaseWeights parse_base_weights(const std::string& text);

}  // namespace headroom
