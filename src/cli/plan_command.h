// `headroom plan`: the CLI binding of plan/planner.h, and the plan choice behind `train --plan auto`.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

#include "config/run_config.h"

namespace headroom {

void add_plan_command(CLI::App& app, std::function<int()>& run);

// For `train --plan auto`: `config` set to the fastest plan that fits its budget, keeping its
// batch × accum sequences per step. Prints the choice to stderr unless quiet; throws DoesNotFit
// (exit code 3) when nothing fits.
RunConfig choose_plan(const RunConfig& config);

}  // namespace headroom
