// An estimate from a recorded allocation trace: the storages a training step allocated and freed,
// in order, each with its phase and what it is. The any-model path (python/headroom/anymodel.py)
// records it by running the user's own model on fake tensors, so no byte is computed; this turns
// it into the Estimate every other path returns — peak, its phase and breakdown, per-phase peaks —
// and, through the caching allocator's policy (estimate/reserved.h), the bytes a CUDA card would
// reserve for the same sequence.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "estimate/estimator.h"
#include "memory/allocator_config.h"
#include "memory/phase.h"

namespace headroom {

struct TracedEvent {
  int64_t storage = 0;  // the storage's id in the trace
  int64_t bytes = 0;    // as allocated (the storage's nbytes)
  bool allocated = true;
  Phase phase = Phase::idle;
  int label = 0;  // index into TracedStep::labels (allocations only)
};

struct TracedStep {
  std::string model;
  int64_t params = 0;
  std::vector<sim::Label> labels;
  std::vector<TracedEvent> events;
  size_t step_begin = 0;  // events before it are the setup (weights, inputs), played once
  bool cuda = false;      // blocks of 512 bytes, as max_memory_allocated counts them
  AllocatorConfig caching;
};

// Frees of storages the trace never saw allocated (made before it began) are ignored.
Estimate estimate_traced(const TracedStep& step);

}  // namespace headroom
