// DeviceAnalyzer — one device's part of analyze_snapshot (snapshot/snapshot_analysis.h), as passes
// over its trace, in the order run() makes them:
//   - the final state: the device's segments, which are the state after the last event
//     (snapshot_analysis.cpp);
//   - pass 1, the totals: allocated and reserved through the trace from the final state undone,
//     their peaks, the timeline, and the moment the segments are looked at, while reserved stays at
//     its peak (snapshot_analysis.cpp); every running sum is checked here to stay within 2^60
//     bytes, so that the later passes over the same events stay within 64 bits;
//   - the iterations (snapshot/iterations.h);
//   - pass 2, the live blocks: those live when the trace began, then each event's, grouped by site
//     at the peak and at each OOM, the segments at the peak reserved, each iteration's figures and
//     the leak verdict and sites (snapshot_analysis_live.cpp);
//   - the allocator replays (snapshot/allocator_replay.h), each OOM's levers (snapshot_analysis_oom.cpp)
//     and the fragmentation verdict (snapshot_analysis_fragmentation.cpp).
// Notes for the whole analysis (a trace that frees more than it holds, replays skipped) are added
// to `notes`. Private to the snapshot analysis; one analyzer per device, used once.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "snapshot/allocator_replay.h"
#include "snapshot/memory_snapshot.h"
#include "snapshot/sites.h"
#include "snapshot/snapshot_analysis.h"
#include "snapshot/trace_accounting.h"
#include "util/error.h"

namespace headroom::snapshot_analysis {

class DeviceAnalyzer {
 public:
  DeviceAnalyzer(const MemorySnapshot& s, int64_t device, const std::deque<SnapshotEvent>& ev, Sites& sites,
                 const AnalyzeOptions& o, std::vector<std::string>& notes);

  DeviceAnalysis run();

 private:
  using SegmentMap = std::map<uint64_t, std::pair<int64_t, bool>>;  // address -> size, expandable

  // What an OOM's levers need of the live blocks at the failure (oom_at, for oom_levers).
  struct OomFacts {
    int64_t iteration = -1;
    int64_t forward = 0, optimizer = 0, leaked = 0;
  };

  // ---- the final state and pass 1 (snapshot_analysis.cpp) ----
  void add_checked(int64_t& acc, int64_t v, const char* what) const {
    if (__builtin_add_overflow(acc, v, &acc) || acc > kMaxSum || acc < -kMaxSum) {
      fail("device {}: {} add up to more than 2^60 bytes; not a memory snapshot of a device", r_.device, what);
    }
  }
  void final_state();
  void pass_totals();
  void state_at_start();
  void peaks_and_timeline();
  void segments_moment();

  // ---- pass 2 (snapshot_analysis_live.cpp) ----
  int64_t iteration_of(int64_t event) const;
  void pass_live();
  LiveMap live_at_start(SegmentMap& segs) const;
  void segments_at_peak(const LiveMap& live, const SegmentMap& segs);
  void leak(const LiveMap& live);
  void leak_sites(const LiveMap& live);

  // ---- fragmentation (snapshot_analysis_fragmentation.cpp) ----
  void replays();
  void fragmentation_verdict();

  // ---- OOMs (snapshot_analysis_oom.cpp) ----
  void oom_at(int64_t i, int64_t a, const LiveMap& live);
  int64_t reserved_before(int64_t i) const;
  void oom_levers();

  static constexpr int64_t kMaxSum = int64_t{1} << 60;

  const MemorySnapshot& s_;
  const std::deque<SnapshotEvent>& ev_;
  Sites& sites_;
  const AnalyzeOptions& o_;
  std::vector<std::string>& notes_;
  DeviceAnalysis r_;
  bool use_completed_ = true;
  int64_t largest_request_ = 0;
  int64_t segments_event_ = -1;  // when the segments are looked at: at the peak reserved
  std::vector<int64_t> iteration_starts_;
  InitialBlocks initial_;  // live when the trace began
  std::vector<OomFacts> oom_facts_;
  std::vector<std::map<int64_t, int64_t>> replay_reserved_at_oom_;
};

}  // namespace headroom::snapshot_analysis
