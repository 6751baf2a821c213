// The run flags every training-shaped command shares (--model, --set, --batch, ..., --config
// run.toml), bound to a CLI11 subcommand from the one field table in config/run_config.h.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "config/run_config.h"

namespace headroom {

// Adds the flags to `cmd` — all of them, or only the keys in `only` when it is not empty (a command
// lists just the flags it uses, so that its --help tells the truth). After parsing, the returned
// function builds the RunConfig: `base` (the defaults), then the --config file, then the flags given.
std::function<RunConfig()> bind_run_flags(CLI::App* cmd, const std::vector<std::string>& only = {},
                                          const RunConfig& base = {});

// The memory a search or plan must fit into: --memory-budget, or on cuda the device's free memory;
// on cpu without a budget, an error naming `command`.
int64_t device_budget(const RunConfig& config, const std::string& command);

}  // namespace headroom
