// Reading whole files, with errors a user can act on.
#pragma once

#include <string>
#include <string_view>

namespace headroom {

// Reads `path` (a regular file) whole. Throws Error naming `flag` and the path when it is missing,
// a directory or unreadable.
std::string read_file(const std::string& path, std::string_view flag);

// The first line of a possibly multi-line message (exception texts carry backtraces).
std::string first_line(std::string_view text);

}  // namespace headroom
