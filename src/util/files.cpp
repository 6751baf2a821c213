#include "util/files.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "util/error.h"

namespace headroom {

std::string read_file(const std::string& path, std::string_view flag, int64_t max_bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) fail("{}: cannot read '{}': {}", flag, path, std::strerror(errno));
  if (S_ISDIR(st.st_mode)) fail("{}: '{}' is a directory; give a file", flag, path);
  // A device or a pipe (/dev/zero, /dev/urandom) would be read without end.
  if (!S_ISREG(st.st_mode)) fail("{}: '{}' is not a regular file; accepted: a regular file", flag, path);
  if (st.st_size > max_bytes) {
    fail("{}: '{}' is {} bytes; accepted: at most {} bytes", flag, path, static_cast<int64_t>(st.st_size), max_bytes);
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot read '{}'", flag, path);
  std::string out(static_cast<size_t>(st.st_size), '\0');
  in.read(out.data(), static_cast<std::streamsize>(out.size()));
  out.resize(static_cast<size_t>(in.gcount()));
  return out;
}

std::string first_line(std::string_view text) { return std::string(text.substr(0, text.find('\n'))); }

std::string last_line(std::string_view text) {
  while (!text.empty() && text.back() == '\n') text.remove_suffix(1);
  const size_t nl = text.rfind('\n');
  return std::string(nl == std::string_view::npos ? text : text.substr(nl + 1));
}

}  // namespace headroom
