// The memory snapshot of the cpu caching allocator, in the structure of PyTorch's
// torch.cuda.memory._snapshot() (torch/csrc/cuda/memory_snapshot.cpp): "segments", each with its
// "blocks"; "device_traces", one list of events (alloc, free_requested, free_completed,
// segment_alloc, segment_free, segment_map, segment_unmap, oom) with sizes, addresses, stream and
// time; "allocator_settings". Frames are the step and phase an event happened in, where known.
// Pickled (device/pickle_adapter.h), it opens in pytorch.org/memory_viz.
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "memory/allocator_config.h"
#include "memory/budget_allocator.h"
#include "memory/caching_policy.h"

namespace headroom {

nlohmann::json allocator_snapshot(const std::vector<SegmentInfo>& segments, const std::vector<HistoryEntry>& history,
                                  const AllocatorConfig& config);

}  // namespace headroom
