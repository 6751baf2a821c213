#include "snapshot/iterations.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <unordered_map>

#include "util/size.h"
#include "util/stats.h"

namespace headroom::snapshot_analysis {
namespace {

// The trace's allocations: the event of each, and its key (the site's file and line, and the size).
struct Allocations {
  std::vector<int64_t> where;  // alloc events
  std::vector<uint64_t> keys;
  std::unordered_map<uint64_t, std::vector<int64_t>> at;  // key -> its occurrences (indices into keys)
};

Allocations allocations(const std::deque<SnapshotEvent>& ev, Sites& sites) {
  Allocations a;
  for (int64_t i = 0; i < static_cast<int64_t>(ev.size()); ++i) {
    const SnapshotEvent& e = ev[i];
    if (e.action != SnapshotAction::alloc) continue;
    a.where.push_back(i);
    a.keys.push_back(sites.info(e.stack).key * 0x100000001b3ull ^ static_cast<uint64_t>(e.size));
  }
  for (int64_t j = 0; j < static_cast<int64_t>(a.keys.size()); ++j) a.at[a.keys[j]].push_back(j);
  return a;
}

// Candidates: (period, anchor), for keys that recur three times or more at a steady spacing,
// covering most of the trace; period -> anchor (the earliest such key).
std::map<int64_t, uint64_t> candidate_periods(Allocations& a) {
  const auto n = static_cast<int64_t>(a.keys.size());
  std::map<int64_t, uint64_t> candidates;
  for (int64_t j = 0; j < n; ++j) {
    const auto& occ = a.at[a.keys[j]];
    if (occ.size() < 3 || occ.front() != j) continue;
    std::vector<double> gaps;
    for (size_t k = 0; k + 1 < occ.size(); ++k) gaps.push_back(static_cast<double>(occ[k + 1] - occ[k]));
    const auto period = static_cast<int64_t>(median(gaps));
    // Iterations after a set-up (building the model): they must cover half the allocations.
    if (period < 1 || static_cast<double>(period) * static_cast<double>(occ.size()) < 0.5 * static_cast<double>(n)) {
      continue;
    }
    candidates.try_emplace(period, a.keys[j]);
  }
  return candidates;
}

struct Period {
  int64_t period;
  uint64_t anchor;
  double fraction;  // of the allocations from the anchor's first on that equal the one a period later
  int64_t covered;  // allocations the period explains
};

// The candidates (shortest first, 64 at most) whose pattern repeats for 80% of the allocations.
std::vector<Period> repeating_periods(const std::map<int64_t, uint64_t>& candidates, Allocations& a) {
  const auto n = static_cast<int64_t>(a.keys.size());
  std::vector<Period> found;
  int64_t tried = 0;
  for (const auto& [period, anchor] : candidates) {  // shortest first
    if (++tried > 64) break;
    const int64_t from = a.at[anchor].front();
    int64_t same = 0;
    for (int64_t j = from; j + period < n; ++j) same += a.keys[j] == a.keys[j + period] ? 1 : 0;
    const double fraction = static_cast<double>(same) / static_cast<double>(std::max<int64_t>(1, n - period - from));
    if (fraction >= 0.8)
      found.push_back({period, anchor, fraction, period * static_cast<int64_t>(a.at[anchor].size())});
  }
  return found;
}

}  // namespace

IterationSearch find_iterations(const std::deque<SnapshotEvent>& ev, Sites& sites) {
  IterationSearch out;
  if (ev.empty()) {
    out.reason = "no trace: torch.cuda.memory._record_memory_history() was not on";
    return out;
  }
  Allocations a = allocations(ev, sites);
  const std::map<int64_t, uint64_t> candidates = candidate_periods(a);
  // Of the periods that repeat, the one that explains the most allocations (a training loop over an
  // evaluation loop); of those within a tenth of it, the shortest (one iteration, not ten).
  const std::vector<Period> found = repeating_periods(candidates, a);
  int64_t most = 0;
  for (const Period& f : found) most = std::max(most, f.covered);
  for (const Period& f : found) {  // shortest first
    if (static_cast<double>(f.covered) < 0.9 * static_cast<double>(most)) continue;
    for (int64_t j : a.at[f.anchor]) out.starts.push_back(a.where[j]);
    out.found = true;
    const SnapshotEvent& first = ev[out.starts.front()];
    out.reason = fmt::format(
        "{} iterations of {} allocations ({:.0f}% of the allocations from the first on repeat one iteration later), "
        "each starting with the allocation of {} at {}",
        out.starts.size(), f.period, 100 * f.fraction, format_bytes(first.size),
        sites.label(sites.info(first.stack).site));
    return out;
  }
  out.reason = candidates.empty() ? "no allocation recurs at a steady spacing through the trace"
                                  : "no recurring allocation marks a pattern that repeats through the trace";
  return out;
}

}  // namespace headroom::snapshot_analysis
