// headroom::Error — the error a user can cause (bad config, missing file, budget too small).
//
// Thrown with a one-line message that names the bad input and says what is accepted; the CLI prints
// it as "headroom: error: <message>" and exits with kExitUsage. Bugs are not Errors: they are checks
// (TORCH_CHECK / assert) that say what invariant broke.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace headroom {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// A configuration that cannot fit in the memory it is given (nothing to retry): exit code 3.
class DoesNotFit : public Error {
 public:
  using Error::Error;
};

// Formats and throws an Error: fail("--batch must be positive, got {}", n).
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

// Process exit codes, documented in `headroom --help`.
inline constexpr int kExitOk = 0;
inline constexpr int kExitUsage = 2;     // bad input: flags, config, files
inline constexpr int kExitOom = 3;       // out of memory (budget or device) and not recovered
inline constexpr int kExitInternal = 4;  // a bug: an unexpected exception
inline constexpr int kExitDiverged = 5;  // training diverged: the loss stopped being finite
// Interrupted by a signal: 128 + the signal, as shells report it (130 for SIGINT, 143 for SIGTERM).

}  // namespace headroom
