// headroom.analyze_snapshot: snapshot/snapshot_analysis.h, the same analysis as `headroom analyze`.
#include "bindings.h"
#include "snapshot/analysis_html.h"
#include "snapshot/memory_snapshot.h"
#include "snapshot/snapshot_analysis.h"
#include "util/atomic_file.h"
#include "util/json.h"

namespace headroom::python {

void bind_snapshot(pybind11::module_& m) {
  m.def(
      "analyze_snapshot",
      [](const std::string& path, int64_t top, const std::string& report) {
        AnalyzeOptions options;
        options.top_sites = top;
        const SnapshotAnalysis a = analyze_snapshot(read_memory_snapshot(path), path, options);
        if (!report.empty()) write_file_atomically(report, analysis_html(a), "report");
        return dump_json(a.to_json());
      },
      pybind11::arg("path"), pybind11::arg("top"), pybind11::arg("report"),
      pybind11::call_guard<pybind11::gil_scoped_release>(),
      "The analysis of a memory snapshot pickle as JSON text (the CLI's --json); an HTML report too if asked.");
}

}  // namespace headroom::python
