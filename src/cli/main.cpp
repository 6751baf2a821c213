// headroom — makes Transformer training fit in accelerator memory. Entry point: parses the command
// line, runs one subcommand, and turns every failure into a one-line message and an exit code.
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/analyze_command.h"
#include "cli/doctor_command.h"
#include "cli/estimate_command.h"
#include "cli/fit_command.h"
#include "cli/plan_command.h"
#include "cli/train_command.h"
#include "util/error.h"
#include "util/files.h"
#include "util/interrupt.h"
#include "util/json.h"

namespace {

bool wants_json(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--json") return true;
  }
  return false;
}

int report(bool json, int code, const std::string& kind, const std::string& message) {
  fmt::print(stderr, "headroom: {}: {}\n", kind, message);
  if (json) fmt::print("{}\n", headroom::dump_json({{"error", message}, {"kind", kind}, {"exit_code", code}}));
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace headroom;
  // The binary the doctor starts as data-parallel ranks (dist/local_ranks.h): this one.
  {
    std::error_code ec;
    const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) ::setenv("HEADROOM_EXECUTABLE", self.c_str(), /*overwrite=*/0);
  }
  CLI::App app{"headroom: makes Transformer training fit in accelerator memory.", "headroom"};
  app.require_subcommand(1);
  app.footer(
      "Sizes accept 512MiB, 24GiB, 80GB. Every command takes --json and then prints exactly one JSON object on "
      "stdout.\n"
      "Exit codes: 0 success; 2 bad input (flags, config, files); 3 does not fit: out of memory that the OOM "
      "guard could not absorb (or with --no-guard), with a diagnosis, or a prediction, plan or search that finds "
      "nothing fitting; 4 internal error; 5 training diverged (the loss stopped being finite); 130 and 143 "
      "interrupted by Ctrl-C or SIGTERM (train stops after the step in flight, with a checkpoint when one is "
      "configured).");
  std::function<int()> run;
  add_train_command(app, run);
  add_fit_command(app, run);
  add_estimate_command(app, run);
  add_plan_command(app, run);
  add_doctor_command(app, run);
  add_analyze_command(app, run);

  const bool json = wants_json(argc, argv);
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    names.push_back(sub->get_name());
  if (argc > 1 && argv[1][0] != '-' && std::find(names.begin(), names.end(), argv[1]) == names.end()) {
    return report(json, kExitUsage, "error",
                  fmt::format("unknown command '{}'; commands: {}", argv[1], fmt::join(names, ", ")));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return report(json, kExitUsage, "error", first_line(e.what()) + " (see headroom --help)");
  }
  try {
    return run ? run() : kExitUsage;
  } catch (const Interrupted& e) {
    return report(json, e.exit_code(), "interrupted", e.what());
  } catch (const DoesNotFit& e) {
    return report(json, kExitOom, "does not fit", e.what());
  } catch (const Error& e) {
    return report(json, kExitUsage, "error", e.what());
  } catch (const c10::OutOfMemoryError& e) {
    return report(json, kExitOom, "out of memory", first_line(e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    return report(json, kExitInternal, "internal error", first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return report(json, kExitInternal, "internal error", first_line(e.what()));
  }
}
