#include "config/moe_routing.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "util/error.h"

namespace headroom {

std::string MoeRouting::name() const {
  if (worst) return "worst";
  if (skew == 1.0) return "balanced";
  return fmt::format("{}", skew);
}

std::vector<int64_t> MoeRouting::loads(int64_t rows, int64_t experts, int64_t top_k) const {
  std::vector<int64_t> out(static_cast<size_t>(experts), 0);
  const int64_t total = rows * top_k;
  if (worst) {
    for (int64_t e = 0; e < top_k; ++e) out[static_cast<size_t>(e)] = rows;
    return out;
  }
  auto spread = [&](int64_t amount, size_t from) {
    const int64_t n = experts - static_cast<int64_t>(from);
    for (size_t e = from; e < out.size(); ++e) {
      out[e] = amount / n + (static_cast<int64_t>(e - from) < amount % n ? 1 : 0);
    }
  };
  if (skew == 1.0 || experts == 1) {
    spread(total, 0);
    return out;
  }
  const double balanced = static_cast<double>(total) / static_cast<double>(experts);
  out[0] = std::min<int64_t>(rows, static_cast<int64_t>(std::ceil(skew * balanced)));
  spread(total - out[0], 1);
  return out;
}

MoeRouting parse_moe_routing(const std::string& text) {
  MoeRouting r;
  if (text == "balanced") return r;
  if (text == "worst") {
    r.worst = true;
    return r;
  }
  char* end = nullptr;
  const double skew = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !(skew >= 1.0) || skew > 1e6) {
    fail("--moe-routing '{}': accepted: balanced, worst, or the hottest expert's load relative to the balanced "
         "share, a number >= 1 (e.g. 1.8, as `headroom train` reports it)",
         text);
  }
  r.skew = skew;
  return r;
}

}  // namespace headroom
