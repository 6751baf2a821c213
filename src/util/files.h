// Reading whole files, with errors a user can act on.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace headroom {

// Reads `path` whole. Throws Error naming `flag` and the path when it is missing, a directory, not
// a regular file (a device or pipe, which could be read without end), larger than `max_bytes`, or
// unreadable.
std::string read_file(const std::string& path, std::string_view flag, int64_t max_bytes = int64_t{1} << 30);

// The first line of a possibly multi-line message (exception texts carry backtraces).
std::string first_line(std::string_view text);
// The last non-empty line of a text (a process's final output line).
std::string last_line(std::string_view text);

}  // namespace headroom
