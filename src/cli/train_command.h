// `headroom train`: the CLI binding of train/trainer.h.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace headroom {

// Adds the subcommand to `app`; when it is chosen, `run` is set to a function that executes it and
// returns the process exit code.
void add_train_command(CLI::App& app, std::function<int()>& run);

}  // namespace headroom
