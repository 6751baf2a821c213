// `headroom estimate`: the CLI binding of estimate/estimator.h — a prediction, no run.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace headroom {

void add_estimate_command(CLI::App& app, std::function<int()>& run);

}  // namespace headroom
