// Pass 2 of the snapshot analysis (snapshot/device_analyzer.h): the live blocks through the trace.
#include <fmt/format.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "memory/caching_policy.h"
#include "memory/leak_detector.h"
#include "snapshot/device_analyzer.h"
#include "util/size.h"

namespace headroom::snapshot_analysis {

int64_t DeviceAnalyzer::iteration_of(int64_t event) const {
  const auto it = std::upper_bound(iteration_starts_.begin(), iteration_starts_.end(), event);
  return static_cast<int64_t>(it - iteration_starts_.begin()) - 1;  // -1: before the first
}

// Pass 2: the live blocks, grouped at the peak and at each OOM; the segments at the peak reserved;
// each iteration's figures; the leak sites.
void DeviceAnalyzer::pass_live() {
  SegmentMap segs;
  LiveMap live = live_at_start(segs);
  for (const auto& [addr, b] : live) initial_.emplace_back(addr, b);

  const int64_t n = static_cast<int64_t>(ev_.size());
  auto snapshot_peak = [&] { r_.live_at_peak = group_live(live, sites_, o_.top_sites); };
  if (r_.peak_allocated_event < 0) snapshot_peak();
  if (segments_event_ < 0) segments_at_peak(live, segs);

  std::vector<Iteration>& its = r_.iterations;
  for (int64_t s : iteration_starts_) its.push_back({s, ev_[s].time_us, 0, 0});
  int64_t a = r_.allocated_at_start;
  int64_t current = -1;
  for (int64_t i = 0; i < n; ++i) {
    const SnapshotEvent& e = ev_[i];
    if (!iteration_starts_.empty() && current + 1 < static_cast<int64_t>(its.size()) &&
        i == its[current + 1].first_event) {
      ++current;
      its[current].live_at_start = its[current].peak = a;
    }
    if (e.action == SnapshotAction::alloc) {
      a += e.size;
      live[e.address] = {e.size, e.stack, i, e.stream};
    } else if (is_free(e.action, use_completed_)) {
      a -= e.size;
      live.erase(e.address);  // none: freed twice, or an inconsistent trace
    } else if (adds_reserved(e.action)) {
      segs[e.address] = {e.size, e.action == SnapshotAction::segment_map};
    } else if (drops_reserved(e.action)) {
      segs.erase(e.address);
    } else if (e.action == SnapshotAction::oom && r_.ooms.size() < 20) {
      oom_at(i, a, live);
    }
    if (current >= 0) its[current].peak = std::max(its[current].peak, a);
    if (i == r_.peak_allocated_event) snapshot_peak();
    if (i == segments_event_) segments_at_peak(live, segs);
  }
  if (r_.iterations_found) leak(live);
}

// Live when the trace began: blocks the segments still hold that no event allocated, and blocks
// the trace frees before (or without) allocating them. `segs` gets the segments held then: those
// of the final state the trace did not make, and those it drops without having made them.
LiveMap DeviceAnalyzer::live_at_start(SegmentMap& segs) const {
  LiveMap live;
  live.reserve(1024);
  std::unordered_set<uint64_t> allocated_in_trace, segment_made;
  std::vector<std::pair<uint64_t, LiveBlock>> freed_first;  // freed before (or without) being allocated
  {
    std::unordered_set<uint64_t> seen;
    for (const SnapshotEvent& e : ev_) {
      if (e.action == SnapshotAction::alloc) allocated_in_trace.insert(e.address);
      if (is_free(e.action, use_completed_) && !allocated_in_trace.count(e.address)) {
        freed_first.push_back({e.address, {e.size, kBeforeTraceStack, -1, e.stream}});
      }
      if (adds_reserved(e.action)) segment_made.insert(e.address);
      if (drops_reserved(e.action) && !segment_made.count(e.address) && seen.insert(e.address).second) {
        segs[e.address] = {e.size, e.action == SnapshotAction::segment_unmap};
      }
    }
  }
  for (const SnapshotSegment& seg : s_.segments) {
    if (seg.device != r_.device) continue;
    if (!segment_made.count(seg.address)) segs[seg.address] = {seg.total_size, seg.expandable};
    for (const SnapshotBlock& b : seg.blocks) {
      if (b.state == BlockState::inactive || allocated_in_trace.count(b.address)) continue;
      live[b.address] = {b.requested, b.stack, -1, seg.stream};
    }
  }
  for (const auto& [addr, b] : freed_first) live.try_emplace(addr, b);
  return live;
}

void DeviceAnalyzer::segments_at_peak(const LiveMap& live, const SegmentMap& segs) {
  CachingPolicy rounding;
  std::vector<std::pair<uint64_t, int64_t>> blocks;
  blocks.reserve(live.size());
  for (const auto& [addr, b] : live) blocks.emplace_back(addr, rounding.round_size(std::max<int64_t>(b.size, 1)));
  std::sort(blocks.begin(), blocks.end());
  std::vector<SegmentState> states;
  // One sweep: segments in address order, each ending where the next begins (they never overlap
  // in a real snapshot), the block cursor only moving forward.
  auto cursor = blocks.begin();
  for (auto seg = segs.begin(); seg != segs.end(); ++seg) {
    const uint64_t addr = seg->first;
    const auto& [size, expandable] = seg->second;
    uint64_t end = addr + static_cast<uint64_t>(size);
    if (const auto next = std::next(seg); next != segs.end()) end = std::min(end, next->first);
    cursor = std::lower_bound(cursor, blocks.end(), std::make_pair(addr, int64_t{0}));
    int64_t used = 0;
    for (; cursor != blocks.end() && cursor->first < end; ++cursor) used += cursor->second;
    if (expandable) continue;
    if (used == 0) {
      r_.free_segments_at_peak += size;
      continue;
    }
    SegmentState st{addr, size, std::min(used, size), std::max<int64_t>(0, size - used), size == kSmallBuffer};
    r_.inactive_split_at_peak += st.inactive_split;
    if (st.inactive_split > 0) states.push_back(st);
  }
  std::sort(states.begin(), states.end(),
            [](const SegmentState& x, const SegmentState& y) { return x.inactive_split > y.inactive_split; });
  if (states.size() > 10) states.resize(10);
  r_.fragmented_segments = std::move(states);
}

// The leak verdict over the iterations (memory/leak_detector.h), then the sites that leak.
void DeviceAnalyzer::leak(const LiveMap& live) {
  std::vector<Iteration>& its = r_.iterations;
  // Each iteration's live bytes when the next began (the same point of the loop each time; the last
  // iteration, which may be in flight, has none).
  std::vector<StepLive> steps;
  for (size_t k = 0; k + 1 < its.size(); ++k) {
    steps.push_back({static_cast<int64_t>(k + 1), its[k + 1].live_at_start, its[k].peak - its[k].live_at_start});
  }
  // Pairwise slopes are quadratic: a long trace is judged on 200 iterations spread over it.
  if (steps.size() > 200) {
    std::vector<StepLive> spread;
    for (size_t k = 0; k < 200; ++k) spread.push_back(steps[k * (steps.size() - 1) / 199]);
    steps = std::move(spread);
  }
  LeakOptions lo;
  lo.warmup_steps = 1;
  lo.min_steps = 3;
  r_.leak = judge_growth(steps, lo);
  r_.leak.reason = "over iterations: " + r_.leak.reason;
  leak_sites(live);
}

// Sites: allocations made in an iteration after the first and before the last (which may be in
// flight) that are still live at the end, in half the iterations or more (two at least).
void DeviceAnalyzer::leak_sites(const LiveMap& live) {
  const int64_t last = static_cast<int64_t>(r_.iterations.size()) - 1;
  struct Acc {
    int64_t bytes = 0, count = 0;
    std::unordered_set<int64_t> iterations;
  };
  std::unordered_map<int32_t, Acc> by_site;
  for (const auto& [addr, b] : live) {
    if (b.event < 0) continue;
    const int64_t k = iteration_of(b.event);
    if (k < 1 || k >= last) continue;
    Acc& acc = by_site[sites_.info(b.stack).family];  // "step N forward": one site across steps
    acc.bytes += b.size;
    ++acc.count;
    acc.iterations.insert(k);
  }
  const int64_t eligible = std::max<int64_t>(1, last - 1);
  for (const auto& [site, acc] : by_site) {
    const auto k = static_cast<int64_t>(acc.iterations.size());
    if (k < std::max<int64_t>(2, eligible / 2)) continue;
    LeakSite ls;
    ls.bytes = acc.bytes / acc.count;
    ls.count = acc.count;
    ls.steps = k;
    ls.origin = sites_.label(site);
    ls.description = fmt::format(
        "{} allocations ({} in all) made at {} in {} of the {} iterations after the first "
        "and still live at the end",
        acc.count, format_bytes(acc.bytes), ls.origin, k, eligible);
    r_.leak.sites.push_back(std::move(ls));
  }
  std::sort(r_.leak.sites.begin(), r_.leak.sites.end(),
            [](const LeakSite& x, const LeakSite& y) { return x.bytes * x.count > y.bytes * y.count; });
}

}  // namespace headroom::snapshot_analysis
