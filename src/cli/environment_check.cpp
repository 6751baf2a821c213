// The environment checked before anything loads: a bad PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF
// is bad input (one line, exit code 2), not a crash.
//
// Why here and this early: LibTorch's CUDA library parses those variables in a static initialiser,
// and a malformed value ("garbage": a key without a value) throws there, so the process aborts
// with a C++ backtrace before main() runs; values it cannot use (an unknown key) fail later, at the
// first CUDA allocation. A check in main() would come too late for the first. The dynamic loader
// runs an executable's .preinit_array before the initialisers of every shared library it loads
// (the ELF rule glibc follows), so this check runs first; re-executing without the variable
// would lose the user's setting for the run that should have it. Only this executable carries it:
// the Python module meets torch's own import, which reads the variables first.
//
// At that point libc is usable but libstdc++'s own initialisers may not have run: the check uses
// strings and exceptions only (no iostreams), takes the environment from the loader's arguments
// and writes its message with write(2).
#include <unistd.h>

#include <cstring>
#include <string>

#include "memory/allocator_config.h"
#include "util/error.h"

namespace {

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// JSON's string escaping, for the --json error object (no library: nothing else may be initialised).
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += static_cast<char>(ch);
    } else if (ch < 0x20) {
      static const char* hex = "0123456789abcdef";
      out += "\\u00";
      out += hex[ch >> 4];
      out += hex[ch & 15];
    } else {
      out += static_cast<char>(ch);
    }
  }
  return out + "\"";
}

void check_environment(int argc, char** argv, char** envp) {
  for (const char* name : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
    const size_t len = std::strlen(name);
    for (char** e = envp; e != nullptr && *e != nullptr; ++e) {
      if (std::strncmp(*e, name, len) != 0 || (*e)[len] != '=') continue;
      try {
        headroom::check_allocator_config(*e + len + 1, name);
      } catch (const headroom::Error& err) {
        const std::string message = err.what();
        write_all(2, "headroom: error: " + message + "\n");
        for (int i = 1; i < argc; ++i) {
          if (std::strcmp(argv[i], "--json") == 0) {
            write_all(1, "{\"error\":" + json_string(message) + ",\"exit_code\":2,\"kind\":\"error\"}\n");
            break;
          }
        }
        ::_exit(2);
      }
    }
  }
}

}  // namespace

// Called by the loader with (argc, argv, envp) before any shared library's initialisers.
__attribute__((section(".preinit_array"), used)) static void (*const headroom_check_environment)(int, char**,
                                                                                                 char**) =
    &check_environment;
