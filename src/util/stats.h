// Small statistics over measurements.
#pragma once

#include <algorithm>
#include <vector>

namespace headroom {

// The median of `values` (the mean of the middle two for an even count); 0 when empty.
inline double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// The median of step times after the first, which warms up (caches, allocator, kernels); the only
// one when there is just one; 0 when none.
inline double median_after_warmup(std::vector<double> seconds) {
  if (seconds.size() > 1) seconds.erase(seconds.begin());
  return median(std::move(seconds));
}

}  // namespace headroom
