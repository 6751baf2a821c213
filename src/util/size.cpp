#include "util/size.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
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
  // A whole number of a unit is exact (a double is not, past 2^53 bytes).
  if (number.find('.') == std::string::npos) {
    int64_t whole = 0;
    std::from_chars(number.data(), number.data() + number.size(), whole);
    const auto unit_bytes = static_cast<int64_t>(scale);
    if (whole <= (int64_t{1} << 62) / unit_bytes) return whole * unit_bytes;
  }
  return static_cast<int64_t>(std::llround(bytes));
}

std::string format_size(int64_t bytes) {
  struct Unit {
    const char* name;
    int64_t bytes;
  };
  // The fewest digits; binary units first, so that they win a tie.
  static constexpr Unit kUnits[] = {{"TiB", int64_t{1} << 40}, {"GiB", int64_t{1} << 30}, {"MiB", int64_t{1} << 20},
                                    {"KiB", int64_t{1} << 10}, {"TB", 1'000'000'000'000}, {"GB", 1'000'000'000},
                                    {"MB", 1'000'000},         {"KB", 1'000}};
  std::string best = std::to_string(bytes);
  size_t digits = best.size();
  for (const Unit& u : kUnits) {
    if (bytes <= 0 || bytes % u.bytes != 0) continue;
    const std::string count = std::to_string(bytes / u.bytes);
    if (count.size() < digits) {
      digits = count.size();
      best = count + u.name;
    }
  }
  return best;
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
