// `headroom doctor`: the CLI binding of doctor/doctor.h — the main job.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace headroom {

void add_doctor_command(CLI::App& app, std::function<int()>& run);

}  // namespace headroom
