// {fmt}'s compiled part, once for every headroom target. LibTorch ships {fmt}'s headers (v12) and
// keeps its own copy of the library hidden inside its libraries, so headroom builds the library's
// functions here instead of in every file that formats: header-only ({fmt}'s FMT_HEADER_ONLY)
// compiled its float printing and formatting engine into each such file, about 1.4 s of compiling
// a file (docs/testing.md).
#include <fmt/format-inl.h>

FMT_BEGIN_NAMESPACE
// The templates format.h declares but leaves to the library: float and double to decimal, and
// the locale's separators for char.
namespace detail {
template FMT_API auto dragonbox::to_decimal(float x) noexcept -> dragonbox::decimal_fp<float>;
template FMT_API auto dragonbox::to_decimal(double x) noexcept -> dragonbox::decimal_fp<double>;
template FMT_API auto thousands_sep_impl(locale_ref) -> thousands_sep_result<char>;
template FMT_API auto decimal_point_impl(locale_ref) -> char;
}  // namespace detail
FMT_END_NAMESPACE
