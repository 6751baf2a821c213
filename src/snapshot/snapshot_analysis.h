// SnapshotAnalysis — what a PyTorch memory snapshot (snapshot/memory_snapshot.h) says, diagnosed in
// the doctor's lever order, per device that has memory or history:
//   1. peak allocated and peak reserved over the trace, when, and what was live at the peak grouped
//      by the allocating code's top user frame (the innermost frame outside torch and outside C++),
//      largest first;
//   2. the iteration structure (a repeating pattern of allocations), each iteration's peak, and the
//      leak verdict over iterations (memory/leak_detector.h's judge_growth) with the sites whose
//      allocations outlive their iteration;
//   10. fragmentation: reserved against allocated over time, inactive-split bytes per segment at the
//      peak reserved (at its most used moment: the segment that makes a peak is empty until the
//      allocation that follows it), what empty_cache would return, and the trace replayed through
//      the caching allocator's policy (memory/caching_policy.h) as recorded, with expandable
//      segments and with max_split_size_mb, each one's peak reserved;
//   and for each OOM event: the request, what was live and cached, and the levers that would have
//   avoided it with the bytes each frees.
// "Allocated" is in requested bytes, as the trace records them (torch.cuda.memory_allocated()
// counts blocks, rounded up to 512 bytes); a live block's size in a segment is its request rounded
// to 512 bytes (a large block's unsplit remainder of up to 1 MiB is counted as inactive split).
// The trace may start after the process did (PyTorch keeps the last 100,000 events by default):
// the totals at its start are the final state (the segments) with the trace undone; blocks the
// segments still hold are live from the start with their own frames, and blocks the trace frees
// without having allocated them are "allocated before the trace began".
// Cost: time linear in the events (the replays are skipped above AnalyzeOptions::replay_limit);
// memory a small multiple of the live blocks.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memory/leak_detector.h"
#include "snapshot/memory_snapshot.h"

namespace headroom {

struct AnalyzeOptions {
  int64_t top_sites = 12;             // groups listed for live memory
  int64_t timeline_points = 400;      // buckets of the reserved/allocated series
  int64_t replay_limit = 20'000'000;  // events; longer traces skip the allocator replays
};

// Live bytes that the same code allocated.
struct SiteGroup {
  std::string site;                  // "train.py:42 in forward"
  std::vector<std::string> callers;  // the next user frames out, up to three
  int64_t bytes = 0;
  int64_t count = 0;
};

struct TimelineBucket {  // events [first_event, first_event + events) of a device's trace
  int64_t first_event = 0;
  int64_t time_us = 0;
  int64_t allocated_min = 0, allocated_max = 0;
  int64_t reserved_max = 0;
};

struct Iteration {
  int64_t first_event = 0;
  int64_t time_us = 0;
  int64_t live_at_start = 0;
  int64_t peak = 0;
};

struct SegmentState {  // a segment at the peak reserved
  uint64_t address = 0;
  int64_t total = 0;
  int64_t allocated = 0;       // its live blocks, rounded as the allocator rounds them
  int64_t inactive_split = 0;  // free bytes in a segment that also holds live blocks
  bool small = false;
};

struct PolicyReplay {
  std::string setting;  // "as recorded", "expandable_segments:True", "max_split_size_mb:128"
  int64_t peak_reserved = 0;
  int64_t peak_allocated = 0;  // blocks, rounded
  int64_t saving = 0;          // against the replay as recorded
};

struct OomLever {
  std::string lever;  // the doctor's names: "allocator settings", "leak", "micro-batch", ...
  std::string setting;
  int64_t bytes = 0;  // what it frees (or would have left free) at the failure
  bool avoids = false;
  std::string note;
};

struct SnapshotOom {
  int64_t event = 0;
  int64_t time_us = 0;
  int64_t requested = 0;
  int64_t allocated = 0;  // live, requested bytes
  int64_t reserved = 0;
  int64_t cached = 0;        // reserved minus allocated
  int64_t device_free = -1;  // as the driver reported it, -1 unknown
  int64_t shortfall = 0;     // the request minus the device's free memory
  std::vector<SiteGroup> live;
  std::vector<OomLever> levers;
  std::string stack;  // where it was asked for: the top user frame
};

struct DeviceAnalysis {
  int64_t device = 0;
  int64_t events = 0;
  int64_t segments = 0;
  bool has_history = false;
  int64_t allocated_at_start = 0, reserved_at_start = 0;
  int64_t allocated_at_end = 0, reserved_at_end = 0;
  int64_t peak_allocated = 0, peak_allocated_event = -1, peak_allocated_time_us = 0;
  int64_t peak_reserved = 0, peak_reserved_event = -1, peak_reserved_time_us = 0;
  std::vector<SiteGroup> live_at_peak;

  bool iterations_found = false;
  std::string iterations_reason;  // how they were found, or why not
  std::vector<Iteration> iterations;
  LeakVerdict leak;

  std::vector<TimelineBucket> timeline;
  int64_t inactive_split_at_peak = 0;             // in segments with live blocks, at the peak reserved
  int64_t free_segments_at_peak = 0;              // whole segments without a live block then (empty_cache's)
  std::vector<SegmentState> fragmented_segments;  // most inactive-split first, at most 10
  int64_t empty_cache_at_end = 0;                 // what empty_cache would return after the last event
  std::vector<PolicyReplay> replays;
  std::string fragmentation;  // one-paragraph verdict

  std::vector<SnapshotOom> ooms;
};

struct SnapshotAnalysis {
  std::string source;
  AllocatorSettings settings;
  std::vector<DeviceAnalysis> devices;
  std::vector<std::string> notes;

  nlohmann::json to_json() const;
  std::string text() const;  // the human report
};

SnapshotAnalysis analyze_snapshot(const MemorySnapshot& snapshot, const std::string& source,
                                  const AnalyzeOptions& options = {});

}  // namespace headroom
