// AtomicFile — writes a file so that readers see the old version or the whole new one, never a
// part: the bytes go to PATH.tmp, which is flushed to disk and renamed over PATH by commit(), and
// the directory entry is flushed too. A file that is not committed (an error, an exception, a
// signal handled by unwinding) is removed, leaving PATH as it was. Errors are Error naming `what`
// (the flag the path came from) and the path.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace headroom {

class AtomicFile {
 public:
  AtomicFile(std::string path, std::string what);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  // Flushes, renames over the destination, flushes the directory. Nothing may be written after.
  void commit();

  const std::string& temp_path() const { return temp_; }

 private:
  std::string path_, temp_, what_;
  int fd_ = -1;
  bool committed_ = false;
};

// The whole of `content` to `path`, atomically.
void write_file_atomically(const std::string& path, std::string_view content, const std::string& what);

}  // namespace headroom
