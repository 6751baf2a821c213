// `headroom analyze SNAPSHOT`: the CLI binding of snapshot/snapshot_analysis.h — diagnoses a
// PyTorch memory snapshot (torch.cuda.memory._dump_snapshot, or headroom's own --memory-snapshot).
// Needs no LibTorch: it is part of the headroom_snapshot library (CMakeLists.txt).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace headroom {

void add_analyze_command(CLI::App& app, std::function<int()>& run);
// The command's options and action on `cmd` itself: the subcommand above, and headroom-analyze's
// whole command line (tools/analyze_main.cpp, the same command without LibTorch's start-up).
void configure_analyze(CLI::App* cmd, std::function<int()>& run);

}  // namespace headroom
