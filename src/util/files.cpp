#include "util/files.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "util/error.h"

namespace headroom {

std::string read_file(const std::string& path, std::string_view flag) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) fail("{}: cannot read '{}': {}", flag, path, std::strerror(errno));
  if (S_ISDIR(st.st_mode)) fail("{}: '{}' is a directory; give a file", flag, path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot read '{}'", flag, path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string first_line(std::string_view text) { return std::string(text.substr(0, text.find('\n'))); }

}  // namespace headroom
