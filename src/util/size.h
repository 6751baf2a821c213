// Byte sizes as users write them ("512MiB", "24GiB", "80GB", "1000") and as headroom prints them;
// durations as it prints them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace headroom {

// Parses a size: a non-negative number with an optional unit B, KB, MB, GB, TB (powers of 1000) or
// KiB, MiB, GiB, TiB (powers of 1024); case-insensitive, a space between is allowed. Throws Error
// naming `what` (e.g. "--memory-budget") on anything else or on a size above 2^62 bytes.
int64_t parse_size(std::string_view text, std::string_view what);

// A size as a person writes it and parse_size reads back to the same bytes: the unit that divides it
// exactly in the fewest digits, binary before decimal ("140MiB", "24GiB", "80GB", "1198MB", "1000").
std::string format_size(int64_t bytes);

// "1.50 GiB", "512.0 MiB", "17 B": binary units, three significant digits.
std::string format_bytes(int64_t bytes);

// "0:42", "12:05", "1:02:03": a duration in whole seconds, for time left.
std::string format_duration(double seconds);

}  // namespace headroom
