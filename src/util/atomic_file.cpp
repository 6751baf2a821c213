#include "util/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "util/error.h"

namespace headroom {

AtomicFile::AtomicFile(std::string path, std::string what)
    : path_(std::move(path)), temp_(path_ + ".tmp"), what_(std::move(what)) {
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{}: cannot write '{}': {}", what_, temp_, std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("{}: writing '{}' failed: {}", what_, temp_, std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) fail("{}: flushing '{}' failed: {}", what_, temp_, std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("{}: closing '{}' failed: {}", what_, temp_, std::strerror(errno));
  if (std::rename(temp_.c_str(), path_.c_str()) != 0) {
    fail("{}: renaming '{}' to '{}' failed: {}", what_, temp_, path_, std::strerror(errno));
  }
  committed_ = true;
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_file_atomically(const std::string& path, std::string_view content, const std::string& what) {
  AtomicFile f(path, what);
  f.write(content);
  f.commit();
}

}  // namespace headroom
