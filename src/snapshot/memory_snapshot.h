// MemorySnapshot — the structure torch.cuda.memory._snapshot() documents (torch/cuda/memory.py),
// read from its pickle (snapshot/pickle_reader.h) into compact typed tables:
//   "segments": [{"device", "address", "total_size", "stream", "segment_type": "small"|"large",
//                 "is_expandable", "frames", "blocks": [{"address", "size", "requested_size",
//                 "state": "active_allocated"|"active_awaiting_free"|"active_pending_free"|"inactive",
//                 "frames"}]}],
//   "device_traces": [[{"action": "alloc"|"free_requested"|"free_completed"|"segment_alloc"|
//                       "segment_free"|"segment_map"|"segment_unmap"|"oom"|"snapshot", "addr",
//                       "size", "stream", "time_us", "device_free" (oom), "frames"}]],
//   "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF", "max_split_size", "expandable_segments", ...},
// each frame {"filename", "line", "name"}. Keys it does not know are ignored; a missing
// "device_traces" (history was not recorded) leaves the traces empty; a missing required key or a
// value of the wrong type is an Error naming where ("device_traces[0][17].size: expected an int").
// Refused too, as no snapshot has them: byte counts above 2^48, records of more than 64 keys, a
// list shared by reference between segments or traces, an event repeated in a trace, more than
// 65,536 streams.
// Frames and stack traces are interned: events that share a traceback share one stack, whether the
// pickle shares the list (PyTorch's, through the memo) or repeats it, so memory stays within a small
// multiple of the file's size however the file is built.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "snapshot/pickle_reader.h"

namespace headroom {

struct SnapshotFrame {
  std::string filename;
  int64_t line = 0;
  std::string name;
};

using StackId = int32_t;  // index into MemorySnapshot::stacks; kNoStack: none recorded
inline constexpr StackId kNoStack = -1;

enum class BlockState : uint8_t { active_allocated, active_awaiting_free, inactive };

struct SnapshotBlock {
  uint64_t address = 0;
  int64_t size = 0;
  int64_t requested = 0;
  BlockState state = BlockState::inactive;
  StackId stack = kNoStack;
};

struct SnapshotSegment {
  int64_t device = 0;
  uint64_t address = 0;
  int64_t total_size = 0;
  uint16_t stream = 0;  // index into MemorySnapshot::streams
  bool small = false;
  bool expandable = false;
  std::vector<SnapshotBlock> blocks;
};

enum class SnapshotAction : uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_alloc,
  segment_free,
  segment_map,
  segment_unmap,
  oom,
  snapshot,
  other
};
const char* snapshot_action_name(SnapshotAction a);

// 32 bytes: a trace of 17 million events (a 1 GB pickle) holds half a gigabyte.
struct SnapshotEvent {
  uint64_t address = 0;  // the block's or segment's; for an oom, device_free() + 1 (0: unknown)
  int64_t size = 0;      // for an oom: the request
  int64_t time_us = 0;
  StackId stack = kNoStack;
  uint16_t stream = 0;  // index into MemorySnapshot::streams
  SnapshotAction action = SnapshotAction::other;
  // An oom's record of what the device still had free; -1 unknown.
  int64_t device_free() const {
    return action == SnapshotAction::oom && address > 0 ? static_cast<int64_t>(address - 1) : -1;
  }
};
static_assert(sizeof(SnapshotEvent) == 32);

struct AllocatorSettings {
  bool known = false;  // the snapshot had "allocator_settings"
  std::string conf;    // PYTORCH_CUDA_ALLOC_CONF as set
  bool expandable_segments = false;
  int64_t max_split_size = -1;  // -1: unlimited
  double garbage_collection_threshold = 0;
};

struct MemorySnapshot {
  std::vector<SnapshotSegment> segments;
  std::vector<std::deque<SnapshotEvent>> traces;   // one per device, in time order (a deque: grown without copies)
  std::vector<int64_t> streams;                    // the streams' ids as recorded (at most 65,536)
  std::vector<SnapshotFrame> frames;               // each distinct frame once
  std::vector<std::vector<int32_t>> stacks;        // frame indices, innermost first, as PyTorch lists them
  AllocatorSettings settings;
};

// Reads the snapshot in the pickle at `path`, taking each trace's events as the pickle is read (the
// document never holds them: PickleSink); any problem is an Error (PickleError for the pickle).
MemorySnapshot read_memory_snapshot(const std::string& path);
// The same for a pickle held in memory; `name` is for messages.
MemorySnapshot read_memory_snapshot_bytes(std::string_view bytes, const std::string& name);
// The snapshot in a document already read; `name` is for messages.
MemorySnapshot memory_snapshot_from(const PickleDocument& doc, const std::string& name);

}  // namespace headroom
