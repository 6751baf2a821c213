#include "optim/quantize8bit.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace headroom {
namespace {

std::array<float, 256> make_map(bool is_signed) {
  constexpr int kDecades = 7;
  std::vector<float> values;
  for (int i = 0; i < kDecades; ++i) {
    // 2^i intervals of [0.1, 1] in decade i (2^(i+1) unsigned), each represented by its midpoint.
    const int intervals = is_signed ? 1 << i : 1 << (i + 1);
    const double decade = std::pow(10.0, -(kDecades - 1) + i);
    for (int k = 0; k < intervals; ++k) {
      const double lo = 0.1 + 0.9 * k / intervals, hi = 0.1 + 0.9 * (k + 1) / intervals;
      const auto v = static_cast<float>(decade * (lo + hi) / 2);
      values.push_back(v);
      if (is_signed) values.push_back(-v);
    }
  }
  values.push_back(0.0F);
  values.push_back(1.0F);
  std::sort(values.begin(), values.end());
  std::array<float, 256> out{};
  std::copy_n(values.begin(), 256, out.begin());
  return out;
}

}  // namespace

const std::array<float, 256>& dynamic_map(bool is_signed) {
  static const std::array<float, 256> signed_map = make_map(true), unsigned_map = make_map(false);
  return is_signed ? signed_map : unsigned_map;
}

uint8_t quantize_nearest(const std::array<float, 256>& map, float x) {
  const auto* above = std::lower_bound(map.begin(), map.end(), x);
  if (above == map.begin()) return 0;
  if (above == map.end()) return 255;
  const auto* below = above - 1;
  return static_cast<uint8_t>((x - *below <= *above - x ? below : above) - map.begin());
}

}  // namespace headroom
