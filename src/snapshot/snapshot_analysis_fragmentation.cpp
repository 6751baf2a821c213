// Fragmentation in the snapshot analysis (snapshot/device_analyzer.h): the trace replayed under
// other allocator settings (snapshot/allocator_replay.h), and the one-paragraph verdict.
#include <fmt/format.h>

#include <algorithm>
#include <unordered_set>

#include "snapshot/device_analyzer.h"
#include "util/size.h"

namespace headroom::snapshot_analysis {

void DeviceAnalyzer::replays() {
  std::unordered_set<int64_t> streams;
  for (const SnapshotEvent& e : ev_) {
    if (streams.insert(e.stream).second && streams.size() > 64) break;
  }
  if (std::max(r_.peak_allocated, r_.peak_reserved) > (int64_t{1} << 50) || streams.size() > 64) {
    notes_.push_back(
        fmt::format("device {}: more than 1 PiB or 64 streams: the allocator settings were not replayed", r_.device));
    return;
  }
  const std::vector<ReplayConfig> configs = replay_configs(s_.settings);
  const int64_t device = std::max<int64_t>(
      int64_t{1} << 40, 4 * std::max({r_.peak_allocated, r_.peak_reserved, r_.allocated_at_start + largest_request_}));
  const std::vector<std::optional<ReplayOutcome>> outcomes =
      run_replays(ev_, initial_, use_completed_, configs, device);
  if (std::any_of(outcomes.begin(), outcomes.end(), [](const auto& o) { return !o.has_value(); })) {
    notes_.push_back(
        fmt::format("device {}: the allocator's policy could not follow the trace (blocks freed that "
                    "it never handed out, or overlapping ones): no replays",
                    r_.device));
    return;
  }
  for (size_t k = 0; k < configs.size(); ++k) {
    const ReplayOutcome& out = *outcomes[k];
    PolicyReplay p{configs[k].name, out.peak_reserved, out.peak_allocated, 0};
    if (!r_.replays.empty()) p.saving = r_.replays.front().peak_reserved - out.peak_reserved;
    r_.replays.push_back(p);
    replay_reserved_at_oom_.push_back(out.reserved_at);
  }
}

void DeviceAnalyzer::fragmentation_verdict() {
  const int64_t gap = r_.peak_reserved - r_.peak_allocated;
  std::string v = fmt::format("reserved peaked at {} against {} allocated at its own peak ({} more)",
                              format_bytes(r_.peak_reserved), format_bytes(r_.peak_allocated), format_bytes(gap));
  if (r_.has_history) {
    v += fmt::format(
        "; at the reserved peak, {} lay free inside segments that also held live blocks (inactive "
        "split) and {} in segments with nothing live",
        format_bytes(r_.inactive_split_at_peak), format_bytes(r_.free_segments_at_peak));
  }
  const PolicyReplay* best = nullptr;
  for (size_t c = 1; c < r_.replays.size(); ++c) {
    if (!best || r_.replays[c].saving > best->saving) best = &r_.replays[c];
  }
  if (!r_.replays.empty()) {
    v += fmt::format("; replayed through the allocator's policy as recorded, reserved peaks at {}",
                     format_bytes(r_.replays.front().peak_reserved));
    if (best && best->saving > 0) {
      v += fmt::format(", and with {} at {} (saves {})", best->setting, format_bytes(best->peak_reserved),
                       format_bytes(best->saving));
    } else if (best) {
      v += "; no allocator setting tried lowers it";
    }
  }
  v += fmt::format("; empty_cache() after the last event would return {}", format_bytes(r_.empty_cache_at_end));
  r_.fragmentation = v;
}

}  // namespace headroom::snapshot_analysis
