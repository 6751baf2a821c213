// A fresh directory under the system temp dir for one test, removed with it.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>

#include <ftw.h>
#include <unistd.h>

namespace headroom::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "headroom-test-XXXXXX").string();
    const char* made = ::mkdtemp(tmpl.data());
    if (made == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path_ = made;
  }
  // Not std::filesystem::remove_all: libtorch.so exports its own copy of that symbol, which the
  // dynamic linker binds first and which crashes (a null call) in this process.
  ~TempDir() {
    ::nftw(path_.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
           FTW_DEPTH | FTW_PHYS);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (std::filesystem::path(path_) / name).string(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace headroom::testing
