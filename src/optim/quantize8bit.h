// Blockwise 8-bit quantisation with a dynamic map, as 8-bit optimizers keep their moments (Dettmers
// et al., "8-bit Optimizers via Block-wise Quantization", 2022): each block of values is scaled by
// its absolute maximum (one float32 per block) and each value stored as the index of the nearest of
// 256 map values.
//
// The dynamic map ("dynamic tree quantisation"): for each of seven decades 10^-6 ... 10^0, values
// evenly spaced over [0.1, 1] of that decade (each the midpoint of its interval), more of them in
// the higher decades; with 0 and 1, 256 values. The signed map (first moments) holds each value and
// its negative; the unsigned one (second moments, never negative) twice as many positive ones.
#pragma once

#include <array>
#include <cstdint>

namespace headroom {

inline constexpr int64_t kQuantBlock = 2048;  // values per absmax

// The 256 values of the dynamic map, ascending.
const std::array<float, 256>& dynamic_map(bool is_signed);

// The index of the map value nearest to `x` (in [-1, 1], or [0, 1] unsigned).
uint8_t quantize_nearest(const std::array<float, 256>& map, float x);

}  // namespace headroom
