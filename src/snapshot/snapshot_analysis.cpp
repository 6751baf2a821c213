#include "snapshot/snapshot_analysis.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "snapshot/device_analyzer.h"
#include "snapshot/iterations.h"
#include "snapshot/sites.h"
#include "util/error.h"

namespace headroom {
namespace snapshot_analysis {

DeviceAnalyzer::DeviceAnalyzer(const MemorySnapshot& s, int64_t device, const std::deque<SnapshotEvent>& ev,
                               Sites& sites, const AnalyzeOptions& o, std::vector<std::string>& notes)
    : s_(s), ev_(ev), sites_(sites), o_(o), notes_(notes) {
  r_.device = device;
  r_.events = static_cast<int64_t>(ev.size());
  r_.has_history = !ev.empty();
}

DeviceAnalysis DeviceAnalyzer::run() {
  final_state();
  pass_totals();
  IterationSearch its = find_iterations(ev_, sites_);
  r_.iterations_found = its.found;
  r_.iterations_reason = std::move(its.reason);
  iteration_starts_ = std::move(its.starts);
  pass_live();
  if (r_.has_history && r_.events <= o_.replay_limit)
    replays();
  else if (r_.has_history)
    notes_.push_back(
        fmt::format("device {}: {} events, above the replay limit of {}: the "
                    "allocator settings were not replayed",
                    r_.device, r_.events, o_.replay_limit));
  oom_levers();
  fragmentation_verdict();
  return std::move(r_);
}

// The segments: the state after the last event.
void DeviceAnalyzer::final_state() {
  for (const SnapshotSegment& seg : s_.segments) {
    if (seg.device != r_.device) continue;
    ++r_.segments;
    add_checked(r_.reserved_at_end, seg.total_size, "its segments");
    bool live = false;
    for (const SnapshotBlock& b : seg.blocks) {
      if (b.state != BlockState::inactive) {
        add_checked(r_.allocated_at_end, b.requested, "its segments' blocks");
        live = true;
      } else if (seg.expandable) {
        add_checked(r_.empty_cache_at_end, b.size, "its segments' blocks");
      }
    }
    if (!live && !seg.expandable) add_checked(r_.empty_cache_at_end, seg.total_size, "its segments");
  }
}

// Pass 1: allocated and reserved through the trace, their peaks and the timeline.
void DeviceAnalyzer::pass_totals() {
  use_completed_ = std::any_of(ev_.begin(), ev_.end(),
                               [](const SnapshotEvent& e) { return e.action == SnapshotAction::free_completed; });
  state_at_start();
  if (ev_.empty()) {
    r_.peak_allocated = r_.allocated_at_end;
    r_.peak_reserved = r_.reserved_at_end;
    return;
  }
  peaks_and_timeline();
  segments_moment();
}

// The totals when the trace began: the final state with the trace's net change undone.
void DeviceAnalyzer::state_at_start() {
  // Sizes are at most 2^48 each (memory_snapshot.h); their running sums are checked here, so that
  // every later pass over the same events stays within 64 bits.
  int64_t net_a = 0, net_r = 0;
  auto add = [&](int64_t& acc, int64_t v) { add_checked(acc, v, "the trace's sizes"); };
  for (const SnapshotEvent& e : ev_) {
    if (e.action == SnapshotAction::alloc) {
      add(net_a, e.size);
    } else if (is_free(e.action, use_completed_)) {
      add(net_a, -e.size);
    } else if (adds_reserved(e.action)) {
      add(net_r, e.size);
    } else if (drops_reserved(e.action)) {
      add(net_r, -e.size);
    }
    largest_request_ = std::max(largest_request_, e.size);
  }
  r_.allocated_at_start = r_.allocated_at_end - net_a;
  r_.reserved_at_start = r_.reserved_at_end - net_r;
  if (r_.allocated_at_start < 0 || r_.reserved_at_start < 0) {
    notes_.push_back(
        fmt::format("device {}: the trace frees more than the segments and the trace account for "
                    "({} allocated, {} reserved at its start); the state before it is taken as empty",
                    r_.device, r_.allocated_at_start, r_.reserved_at_start));
    r_.allocated_at_start = std::max<int64_t>(0, r_.allocated_at_start);
    r_.reserved_at_start = std::max<int64_t>(0, r_.reserved_at_start);
  }
}

// The peaks, and the timeline: the events in timeline_points buckets, each one's range.
void DeviceAnalyzer::peaks_and_timeline() {
  int64_t a = r_.allocated_at_start, res = r_.reserved_at_start;
  r_.peak_allocated = a;
  r_.peak_reserved = res;
  const int64_t n = static_cast<int64_t>(ev_.size());
  const int64_t buckets = std::max<int64_t>(1, std::min(o_.timeline_points, n));
  r_.timeline.resize(buckets);
  for (int64_t b = 0; b < buckets; ++b) {
    TimelineBucket& t = r_.timeline[b];
    t.first_event = b * n / buckets;
    t.allocated_min = std::numeric_limits<int64_t>::max();
  }
  for (int64_t i = 0; i < n; ++i) {
    const SnapshotEvent& e = ev_[i];
    if (e.action == SnapshotAction::alloc)
      a += e.size;
    else if (is_free(e.action, use_completed_))
      a -= e.size;
    else if (adds_reserved(e.action))
      res += e.size;
    else if (drops_reserved(e.action))
      res -= e.size;
    if (a > r_.peak_allocated)
      r_.peak_allocated = a, r_.peak_allocated_event = i, r_.peak_allocated_time_us = e.time_us;
    if (res > r_.peak_reserved)
      r_.peak_reserved = res, r_.peak_reserved_event = i, r_.peak_reserved_time_us = e.time_us;
    TimelineBucket& t = r_.timeline[i * buckets / n];
    if (i == t.first_event) t.time_us = e.time_us;
    t.allocated_min = std::min(t.allocated_min, a);
    t.allocated_max = std::max(t.allocated_max, a);
    t.reserved_max = std::max(t.reserved_max, res);
  }
}

// The segments are looked at while reserved stays at its peak, when most of it is in use (the
// segment that made the peak holds nothing yet at its segment_alloc: its alloc comes next).
void DeviceAnalyzer::segments_moment() {
  segments_event_ = r_.peak_reserved_event;
  if (segments_event_ < 0) return;
  const int64_t n = static_cast<int64_t>(ev_.size());
  int64_t level = 0, best = 0;
  for (int64_t i = r_.peak_reserved_event + 1; i < n; ++i) {
    const SnapshotEvent& e = ev_[i];
    if (adds_reserved(e.action) || drops_reserved(e.action)) break;
    if (e.action == SnapshotAction::alloc) {
      level += e.size;
    } else if (is_free(e.action, use_completed_)) {
      level -= e.size;
    }
    if (level > best) best = level, segments_event_ = i;
  }
}

}  // namespace snapshot_analysis

SnapshotAnalysis analyze_snapshot(const MemorySnapshot& snapshot, const std::string& source,
                                  const AnalyzeOptions& options) {
  SnapshotAnalysis a;
  a.source = source;
  a.settings = snapshot.settings;
  snapshot_analysis::Sites sites(snapshot);
  std::vector<int64_t> devices;
  for (size_t d = 0; d < snapshot.traces.size(); ++d) {
    if (!snapshot.traces[d].empty()) devices.push_back(static_cast<int64_t>(d));
  }
  for (const SnapshotSegment& s : snapshot.segments) devices.push_back(s.device);
  std::sort(devices.begin(), devices.end());
  devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
  static const std::deque<SnapshotEvent> kNone;
  for (int64_t d : devices) {
    const auto& ev = d >= 0 && static_cast<size_t>(d) < snapshot.traces.size() ? snapshot.traces[d] : kNone;
    a.devices.push_back(snapshot_analysis::DeviceAnalyzer(snapshot, d, ev, sites, options, a.notes).run());
  }
  if (a.devices.empty()) a.notes.push_back("the snapshot holds no segments and no trace: nothing was allocated");
  for (const DeviceAnalysis& d : a.devices) {
    if (!d.has_history) {
      a.notes.push_back(
          fmt::format("device {}: no trace (torch.cuda.memory._record_memory_history() was not on "
                      "when it was taken): the peak and the iterations are those of the final state",
                      d.device));
    }
  }
  return a;
}

}  // namespace headroom
