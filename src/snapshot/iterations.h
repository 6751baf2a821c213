// The iteration structure of a device's trace (snapshot/memory_snapshot.h), for the snapshot
// analysis: a repeating pattern of allocations, each keyed by its size and its site's file and line
// (snapshot/sites.h). The sequence repeats with a period P when most allocations equal the one P
// later. Candidate periods come from the allocations that recur three times or more (the median
// spacing of each one's occurrences) and cover half the allocations or more. Of those whose pattern
// holds for 80% of the allocations from the first on, the shortest of the ones that explain within
// a tenth as many allocations as the one that explains the most (a training loop over an
// evaluation loop; one iteration, not ten; a layer's allocations repeat too, but the last layer's
// run on into the backward). An iteration starts at each occurrence of that period's marking
// allocation, one that happens once in each period. At most 64 candidate periods are tried, each
// in one pass over the allocations.
// Private to the snapshot analysis.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "snapshot/memory_snapshot.h"
#include "snapshot/sites.h"

namespace headroom::snapshot_analysis {

struct IterationSearch {
  bool found = false;
  std::string reason;           // how they were found, or why not
  std::vector<int64_t> starts;  // the event each iteration starts at, in order
};

IterationSearch find_iterations(const std::deque<SnapshotEvent>& ev, Sites& sites);

}  // namespace headroom::snapshot_analysis
