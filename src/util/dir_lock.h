// DirLock — one writer per directory: an exclusive advisory lock (flock) on DIR/.headroom.lock,
// holding the owner's pid, for as long as the object lives. Two runs sharing a checkpoint
// directory would race (the second dies renaming the first's temp file); the second is refused at
// its start instead, with the holder's pid. The lock goes with the process, however it ends.
#pragma once

#include <string>

namespace headroom {

class DirLock {
 public:
  // Throws Error naming `flag`, the directory and the pid that holds it when another process does.
  DirLock(const std::string& dir, const std::string& flag);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace headroom
