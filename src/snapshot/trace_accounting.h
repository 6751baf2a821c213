// How snapshot_analysis*.cpp count a trace's events (snapshot/memory_snapshot.h): which free ends a
// block's life (free_completed when the trace has any, else free_requested: one of the two, never
// both, so a block is freed once), which events add and drop reserved bytes (segment_alloc and
// segment_map; segment_free and segment_unmap), and the live blocks kept while walking it. Private
// to the snapshot analysis.
#pragma once

#include <cstdint>
#include <unordered_map>

#include "snapshot/memory_snapshot.h"

namespace headroom::snapshot_analysis {

inline bool is_free(SnapshotAction a, bool use_completed) {
  return a == (use_completed ? SnapshotAction::free_completed : SnapshotAction::free_requested);
}
inline bool adds_reserved(SnapshotAction a) {
  return a == SnapshotAction::segment_alloc || a == SnapshotAction::segment_map;
}
inline bool drops_reserved(SnapshotAction a) {
  return a == SnapshotAction::segment_free || a == SnapshotAction::segment_unmap;
}

// A stack for a block the trace frees without having allocated it (snapshot/sites.h names it).
inline constexpr StackId kBeforeTraceStack = -2;

struct LiveBlock {
  int64_t size = 0;
  StackId stack = kNoStack;
  int64_t event = -1;  // the alloc; -1: before the trace
  int64_t stream = 0;
};
using LiveMap = std::unordered_map<uint64_t, LiveBlock>;  // by address

}  // namespace headroom::snapshot_analysis
