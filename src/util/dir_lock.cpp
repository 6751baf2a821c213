#include "util/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "util/error.h"

namespace headroom {

DirLock::DirLock(const std::string& dir, const std::string& flag) {
  const std::string path = (std::filesystem::path(dir) / ".headroom.lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{}: cannot create the lock '{}': {}", flag, path, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {};
    const ssize_t n = ::pread(fd_, buf, sizeof(buf) - 1, 0);
    const std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "another process";
    ::close(fd_);
    fd_ = -1;
    fail(
        "{} '{}' is in use by process {} (another headroom run writing there); accepted: a directory no other run "
        "writes",
        flag, dir, holder);
  }
  const std::string pid = std::to_string(::getpid());
  if (::ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] const ssize_t w = ::pwrite(fd_, pid.data(), pid.size(), 0);
  }
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

}  // namespace headroom
