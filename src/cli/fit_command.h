// `headroom fit`: the CLI binding of train/batch_search.h.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace headroom {

void add_fit_command(CLI::App& app, std::function<int()>& run);

}  // namespace headroom
