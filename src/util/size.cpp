#include "util/size.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include "util/error.h"

namespace headroom {

int64_t parse_size(std::string_view text, std::string_view what) {
  auto bad = [&]() -> int64_t {
    fail(
        "{}: '{}' is not a size; accepted: a number with an optional unit B, KB, MB, GB, TB, "
        "KiB, MiB, GiB or TiB (e.g. 512MiB, 24GiB, 80GB)",
        what, text);
  };
  std::string s(text);
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0) return bad();
  char* end = nullptr;
  const std::string number = s.substr(0, i);
  const double value = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size() || !std::isfinite(value)) return bad();
  std::string unit;
  for (size_t j = i; j < s.size(); ++j) {
    if (s[j] == ' ' && unit.empty()) continue;
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(s[j])));
  }
  double scale = 0;
  if (unit.empty() || unit == "b")
    scale = 1;
  else if (unit == "kb")
    scale = 1e3;
  else if (unit == "mb")
    scale = 1e6;
  else if (unit == "gb")
    scale = 1e9;
  else if (unit == "tb")
    scale = 1e12;
  else if (unit == "kib")
    scale = 1024.0;
  else if (unit == "mib")
    scale = 1024.0 * 1024;
  else if (unit == "gib")
    scale = 1024.0 * 1024 * 1024;
  else if (unit == "tib")
    scale = 1024.0 * 1024 * 1024 * 1024;
  else
    return bad();
  const double bytes = value * scale;
  if (bytes > std::ldexp(1.0, 62)) {
    fail("{}: '{}' is larger than headroom accepts (at most 4 EiB)", what, text);
  }
  return static_cast<int64_t>(std::llround(bytes));
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes < 0 ? -bytes : bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  const char* sign = bytes < 0 ? "-" : "";
  if (u == 0) return fmt::format("{}{} B", sign, static_cast<int64_t>(v));
  if (v >= 100) return fmt::format("{}{:.0f} {}", sign, v, units[u]);
  if (v >= 10) return fmt::format("{}{:.1f} {}", sign, v, units[u]);
  return fmt::format("{}{:.2f} {}", sign, v, units[u]);
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds) + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

}  // namespace headroom
