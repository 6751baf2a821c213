// Runs a shell command for a test: its stdout (stderr too when the command redirects it), and its
// exit status.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace headroom::testing {

struct CommandResult {
  int code = -1;  // the exit status; -1 when it did not exit normally
  std::string out;
};

inline CommandResult run_command(const std::string& command) {
  CommandResult r;
  std::FILE* p = ::popen(command.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace headroom::testing
