// headroom-analyze — `headroom analyze` as a program of its own, linked without LibTorch (only c10):
// it starts in milliseconds, where loading LibTorch takes about a second and 450 MB before any work,
// which is most of the time and memory for a snapshot of tens of megabytes. Same options, output and
// exit codes as `headroom analyze` (cli/analyze_command.h).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstring>
#include <functional>
#include <string>

#include "cli/analyze_command.h"
#include "util/error.h"
#include "util/json.h"

int main(int argc, char** argv) {
  using namespace headroom;
  bool json = false;
  for (int i = 1; i < argc; ++i) json = json || std::strcmp(argv[i], "--json") == 0;
  auto report = [&](int code, const std::string& kind, std::string message) {
    message = message.substr(0, message.find('\n'));
    fmt::print(stderr, "headroom-analyze: {}: {}\n", kind, message);
    if (json) fmt::print("{}\n", dump_json({{"error", message}, {"kind", kind}, {"exit_code", code}}));
    return code;
  };
  CLI::App app{"", "headroom-analyze"};
  std::function<int()> run;
  configure_analyze(&app, run);
  app.footer(
      "Exit codes: 0 success; 2 bad input (a missing file, or one that is not a plain-data pickle of a memory "
      "snapshot); 4 internal error.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return report(kExitUsage, "error", std::string(e.what()) + " (see headroom-analyze --help)");
  }
  try {
    return run ? run() : kExitUsage;
  } catch (const Error& e) {
    return report(kExitUsage, "error", e.what());
  } catch (const std::exception& e) {
    return report(kExitInternal, "internal error", e.what());
  }
}
