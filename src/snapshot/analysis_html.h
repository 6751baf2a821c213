// The analysis of a memory snapshot as one self-contained HTML page (report/html_page.h: no
// scripts, no network): per device, reserved and allocated over the whole trace as one aggregated
// chart (a few hundred points however long the trace: the peaks, the iterations and any OOM marked
// on it), then the tables of the text report in the doctor's lever order.
#pragma once

#include <string>

#include "snapshot/snapshot_analysis.h"

namespace headroom {

std::string analysis_html(const SnapshotAnalysis& analysis);

}  // namespace headroom
