// `headroom analyze SNAPSHOT`: the CLI binding of snapshot/snapshot_analysis.h — diagnoses a
// PyTorch memory snapshot (torch.cuda.memory._dump_snapshot, or headroom's own --memory-snapshot).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace headroom {

void add_analyze_command(CLI::App& app, std::function<int()>& run);

}  // namespace headroom
