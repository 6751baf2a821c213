#include "cli/analyze_command.h"

#include <fmt/format.h>

#include <cstdio>
#include <memory>

#include "snapshot/analysis_html.h"
#include "snapshot/memory_snapshot.h"
#include "snapshot/snapshot_analysis.h"
#include "util/atomic_file.h"
#include "util/error.h"
#include "util/json.h"

namespace headroom {

void add_analyze_command(CLI::App& app, std::function<int()>& run) {
  configure_analyze(app.add_subcommand("analyze"), run);
}

void configure_analyze(CLI::App* cmd, std::function<int()>& run) {
  cmd->description(
      "Diagnose a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot, or headroom's --memory-snapshot):\n"
      "peak allocated and reserved and what was live then, by the code that allocated it; the iterations and\n"
      "whether memory leaks across them, and where from; fragmentation, with the trace replayed under other\n"
      "allocator settings; and for each OOM, what would have avoided it. The pickle is read safely: only plain\n"
      "data (dict, list, tuple, str, bytes, int, float, bool, None) is accepted, never code or objects by name.\n"
      "Exit code 2 for a file that is not such a snapshot.");
  auto path = std::make_shared<std::string>();
  cmd->add_option("SNAPSHOT", *path, "the snapshot's pickle file")->required();
  auto json = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json, "print the analysis as one JSON object on stdout");
  auto report = std::make_shared<std::string>();
  cmd->add_option("--report", *report, "also write a self-contained HTML report (charts as inline SVG) to FILE");
  auto top = std::make_shared<int64_t>(AnalyzeOptions{}.top_sites);
  cmd->add_option("--top", *top, "how many allocating sites to list for live memory")
      ->default_val(AnalyzeOptions{}.top_sites)
      ->check(CLI::Range(int64_t{1}, int64_t{1000}));
  cmd->callback([path, json, report, top, &run] {
    run = [path, json, report, top]() -> int {
      AnalyzeOptions options;
      options.top_sites = *top;
      const MemorySnapshot snapshot = read_memory_snapshot(*path);
      const SnapshotAnalysis a = analyze_snapshot(snapshot, *path, options);
      if (!report->empty()) write_file_atomically(*report, analysis_html(a), "--report");
      if (*json)
        fmt::print("{}\n", dump_json(a.to_json()));
      else
        fmt::print("{}", a.text());
      if (!report->empty()) fmt::print(stderr, "analyze: report written to {}\n", *report);
      return kExitOk;
    };
  });
}

}  // namespace headroom
