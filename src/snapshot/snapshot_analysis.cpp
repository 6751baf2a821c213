#include "snapshot/snapshot_analysis.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <future>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "memory/allocator_config.h"
#include "memory/caching_policy.h"
#include "util/size.h"
#include "util/stats.h"

namespace headroom {
namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// A frame of the user's own code: Python (or a headroom step) outside torch's package, not C/C++.
bool is_user_frame(const SnapshotFrame& f) {
  const std::string_view n = f.filename;
  if (n.empty() || n == "??" || n.front() == '<') return false;
  for (const char* ext : {".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".cu", ".cuh"}) {
    if (ends_with(n, ext)) return false;
  }
  return n.find("/torch/") == std::string_view::npos && n.rfind("torch/", 0) != 0;
}

std::string frame_label(const SnapshotFrame& f) {
  return f.name.empty() ? fmt::format("{}:{}", f.filename, f.line)
                        : fmt::format("{}:{} in {}", f.filename, f.line, f.name);
}

constexpr const char* kNoStackLabel = "(no stack recorded)";
constexpr const char* kBeforeTrace = "(allocated before the trace began)";
constexpr StackId kBeforeTraceStack = -2;  // a block the trace frees without having allocated it

// Per stack: its site (the top user frame), a key for the iteration search, and what it shows.
class Sites {
 public:
  explicit Sites(const MemorySnapshot& s) : s_(s), info_(s.stacks.size()) {}

  struct Info {
    bool done = false;
    int32_t site = 0;
    int32_t family = 0;      // the site with the numbers in its function's name made N: "step N forward"
    uint64_t key = 0;        // file and line of the site (not the function's name, which may number a step)
    int32_t frame = -1;      // index in the stack of the site's frame
    bool forward = false;    // a frame named forward: made while a module ran forward
    bool optimizer = false;  // a frame inside torch/optim
  };

  const Info& info(StackId id) {
    if (id == kBeforeTraceStack) {
      static const Info before{true, -2, -2, 0x7f4a7c159e3779b9ull, -1, false, false};
      return before;
    }
    if (id == kNoStack || id < 0 || static_cast<size_t>(id) >= info_.size()) {
      static const Info none{true, -1, -1, 0x9e3779b97f4a7c15ull, -1, false, false};
      return none;
    }
    Info& i = info_[id];
    if (i.done) return i;
    i.done = true;
    const auto& stack = s_.stacks[id];
    for (size_t k = 0; k < stack.size(); ++k) {
      const SnapshotFrame& f = s_.frames[stack[k]];
      if (f.name == "forward") i.forward = true;
      if (f.filename.find("torch/optim/") != std::string::npos) i.optimizer = true;
      if (i.frame < 0 && is_user_frame(f)) i.frame = static_cast<int32_t>(k);
    }
    if (i.frame < 0) {  // none of the user's: the first Python frame, else the innermost
      for (size_t k = 0; k < stack.size() && i.frame < 0; ++k) {
        if (ends_with(s_.frames[stack[k]].filename, ".py")) i.frame = static_cast<int32_t>(k);
      }
      if (i.frame < 0 && !stack.empty()) i.frame = 0;
    }
    if (i.frame < 0) {
      i.site = i.family = -1;
      i.key = 0x9e3779b97f4a7c15ull;
      return i;
    }
    const SnapshotFrame& f = s_.frames[stack[i.frame]];
    i.site = site_id(frame_label(f));
    SnapshotFrame numbered = f;
    std::string name;
    for (size_t k = 0; k < f.name.size(); ++k) {
      const bool digit = f.name[k] >= '0' && f.name[k] <= '9';
      if (!digit)
        name += f.name[k];
      else if (k == 0 || f.name[k - 1] < '0' || f.name[k - 1] > '9')
        name += 'N';
    }
    numbered.name = name;
    i.family = site_id(frame_label(numbered));
    i.key = std::hash<std::string>{}(f.filename) * 1000003u ^ static_cast<uint64_t>(f.line);
    return i;
  }
  std::string label(int32_t site) const { return site == -2 ? kBeforeTrace : site < 0 ? kNoStackLabel : labels_[site]; }
  // The next user frames out from the site, up to three.
  std::vector<std::string> callers(StackId id) {
    std::vector<std::string> out;
    const Info& i = info(id);
    if (i.frame < 0) return out;
    const auto& stack = s_.stacks[id];
    for (size_t k = i.frame + 1; k < stack.size() && out.size() < 3; ++k) {
      if (is_user_frame(s_.frames[stack[k]])) out.push_back(frame_label(s_.frames[stack[k]]));
    }
    return out;
  }

 private:
  int32_t site_id(const std::string& label) {
    auto [it, inserted] = ids_.try_emplace(label, static_cast<int32_t>(labels_.size()));
    if (inserted) labels_.push_back(label);
    return it->second;
  }
  const MemorySnapshot& s_;
  std::vector<Info> info_;
  std::vector<std::string> labels_;
  std::unordered_map<std::string, int32_t> ids_;
};

struct LiveBlock {
  int64_t size = 0;
  StackId stack = kNoStack;
  int64_t event = -1;  // the alloc; -1: before the trace
  int64_t stream = 0;
};
using LiveMap = std::unordered_map<uint64_t, LiveBlock>;

std::vector<SiteGroup> group_live(const LiveMap& live, Sites& sites, int64_t top,
                                  const std::function<bool(const LiveBlock&)>& keep = nullptr) {
  struct Acc {
    int64_t bytes = 0, count = 0, largest = -1;
    StackId largest_stack = kNoStack;
  };
  std::unordered_map<int32_t, Acc> by_site;
  for (const auto& [addr, b] : live) {
    if (keep && !keep(b)) continue;
    Acc& a = by_site[sites.info(b.stack).site];
    a.bytes += b.size;
    ++a.count;
    if (b.size > a.largest) a.largest = b.size, a.largest_stack = b.stack;
  }
  std::vector<SiteGroup> out;
  for (const auto& [site, a] : by_site) {
    out.push_back({sites.label(site), sites.callers(a.largest_stack), a.bytes, a.count});
  }
  std::sort(out.begin(), out.end(), [](const SiteGroup& x, const SiteGroup& y) {
    return x.bytes != y.bytes ? x.bytes > y.bytes : x.site < y.site;
  });
  if (static_cast<int64_t>(out.size()) > top) out.resize(top);
  return out;
}

bool is_free(SnapshotAction a, bool use_completed) {
  return a == (use_completed ? SnapshotAction::free_completed : SnapshotAction::free_requested);
}
bool adds_reserved(SnapshotAction a) { return a == SnapshotAction::segment_alloc || a == SnapshotAction::segment_map; }
bool drops_reserved(SnapshotAction a) {
  return a == SnapshotAction::segment_free || a == SnapshotAction::segment_unmap;
}

struct ReplayConfig {
  std::string name;
  AllocatorConfig config;
};

// The trace through the caching allocator's policy under `config`: its peaks, and its reserved
// bytes at each OOM event.
struct ReplayOutcome {
  int64_t peak_reserved = 0, peak_allocated = 0;
  std::map<int64_t, int64_t> reserved_at;  // event -> reserved
};
ReplayOutcome replay(const std::deque<SnapshotEvent>& ev, const std::vector<std::pair<uint64_t, LiveBlock>>& initial,
                     bool use_completed, const AllocatorConfig& config, int64_t device) {
  // A device large enough for the trace, which it never fills (the policy sizes the address space
  // of expandable segments from it): nothing is refused for want of memory.
  CachingPolicy p(config, device);
  std::unordered_map<uint64_t, uint64_t> where;
  std::unordered_map<int64_t, int> streams;
  auto stream = [&](int64_t s) { return streams.try_emplace(s, static_cast<int>(streams.size())).first->second; };
  for (const auto& [addr, b] : initial) {
    if (b.size <= 0) continue;
    if (const auto a = p.allocate(b.size, stream(b.stream))) where[addr] = *a;
  }
  ReplayOutcome out;
  bool freeing_segments = false;
  int64_t emptied = 0;  // each costs a walk of the cached blocks: a thousand at most
  for (size_t i = 0; i < ev.size(); ++i) {
    const SnapshotEvent& e = ev[i];
    if (e.action == SnapshotAction::alloc && e.size > 0) {
      if (const auto a = p.allocate(e.size, stream(e.stream))) where[e.address] = *a;
    } else if (is_free(e.action, use_completed)) {
      if (const auto it = where.find(e.address); it != where.end()) {
        p.free(it->second);
        where.erase(it);
      }
    } else if (e.action == SnapshotAction::segment_free || e.action == SnapshotAction::segment_unmap) {
      // The program (or an OOM's retry) released cached segments here: do the same once.
      if (!freeing_segments && ++emptied <= 1000) p.empty_cache();
      freeing_segments = true;
      continue;
    } else if (e.action == SnapshotAction::oom) {
      out.reserved_at[static_cast<int64_t>(i)] = p.stats().reserved_bytes.current;
    }
    freeing_segments = false;
  }
  out.peak_reserved = p.stats().reserved_bytes.peak;
  out.peak_allocated = p.stats().allocated_bytes.peak;
  return out;
}

class DeviceAnalyzer {
 public:
  DeviceAnalyzer(const MemorySnapshot& s, int64_t device, const std::deque<SnapshotEvent>& ev, Sites& sites,
                 const AnalyzeOptions& o, std::vector<std::string>& notes)
      : s_(s), ev_(ev), sites_(sites), o_(o), notes_(notes) {
    r_.device = device;
    r_.events = static_cast<int64_t>(ev.size());
    r_.has_history = !ev.empty();
  }

  DeviceAnalysis run() {
    final_state();
    pass_totals();
    find_iterations();
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

 private:
  void add_checked(int64_t& acc, int64_t v, const char* what) const {
    if (__builtin_add_overflow(acc, v, &acc) || acc > kMaxSum || acc < -kMaxSum) {
      fail("device {}: {} add up to more than 2^60 bytes; not a memory snapshot of a device", r_.device, what);
    }
  }

  // The segments: the state after the last event.
  void final_state() {
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
  void pass_totals() {
    use_completed_ = std::any_of(ev_.begin(), ev_.end(),
                                 [](const SnapshotEvent& e) { return e.action == SnapshotAction::free_completed; });
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
    int64_t a = r_.allocated_at_start, res = r_.reserved_at_start;
    r_.peak_allocated = a;
    r_.peak_reserved = res;
    if (ev_.empty()) {
      r_.peak_allocated = r_.allocated_at_end;
      r_.peak_reserved = r_.reserved_at_end;
      return;
    }
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
    // The segments are looked at while reserved stays at its peak, when most of it is in use (the
    // segment that made the peak holds nothing yet at its segment_alloc: its alloc comes next).
    segments_event_ = r_.peak_reserved_event;
    if (segments_event_ >= 0) {
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
  }

  // A repeating pattern: the sequence of allocations (each keyed by its size and allocating line)
  // repeats with a period P when most allocations equal the one P later. Candidate periods come from
  // the allocations that recur (the spacing of each one's occurrences); the iteration is the
  // shortest candidate that repeats over most of the trace (a layer's allocations repeat too, but
  // the last layer's run on into the backward; ten iterations repeat too, but are not the shortest),
  // marked by an allocation that happens once in each period.
  void find_iterations() {
    if (ev_.empty()) {
      r_.iterations_reason = "no trace: torch.cuda.memory._record_memory_history() was not on";
      return;
    }
    std::vector<int64_t> where;  // alloc events
    std::vector<uint64_t> keys;
    for (int64_t i = 0; i < static_cast<int64_t>(ev_.size()); ++i) {
      const SnapshotEvent& e = ev_[i];
      if (e.action != SnapshotAction::alloc) continue;
      where.push_back(i);
      keys.push_back(sites_.info(e.stack).key * 0x100000001b3ull ^ static_cast<uint64_t>(e.size));
    }
    const auto n = static_cast<int64_t>(keys.size());
    std::unordered_map<uint64_t, std::vector<int64_t>> at;  // key -> its occurrences
    for (int64_t j = 0; j < n; ++j) at[keys[j]].push_back(j);
    // Candidates: (period, anchor), for keys that recur three times or more at a steady spacing,
    // covering most of the trace.
    std::map<int64_t, uint64_t> candidates;  // period -> anchor (the earliest such key)
    for (int64_t j = 0; j < n; ++j) {
      const auto& occ = at[keys[j]];
      if (occ.size() < 3 || occ.front() != j) continue;
      std::vector<double> gaps;
      for (size_t k = 0; k + 1 < occ.size(); ++k) gaps.push_back(static_cast<double>(occ[k + 1] - occ[k]));
      const auto period = static_cast<int64_t>(median(gaps));
      // Iterations after a set-up (building the model): they must cover half the allocations.
      if (period < 1 || static_cast<double>(period) * static_cast<double>(occ.size()) < 0.5 * static_cast<double>(n)) {
        continue;
      }
      candidates.try_emplace(period, keys[j]);
    }
    // Of the periods that repeat, the one that explains the most allocations (a training loop over an
    // evaluation loop); of those within a tenth of it, the shortest (one iteration, not ten).
    struct Found {
      int64_t period;
      uint64_t anchor;
      double fraction;
      int64_t covered;
    };
    std::vector<Found> found;
    int64_t tried = 0;
    for (const auto& [period, anchor] : candidates) {  // shortest first
      if (++tried > 64) break;
      const int64_t from = at[anchor].front();
      int64_t same = 0;
      for (int64_t j = from; j + period < n; ++j) same += keys[j] == keys[j + period] ? 1 : 0;
      const double fraction = static_cast<double>(same) / static_cast<double>(std::max<int64_t>(1, n - period - from));
      if (fraction >= 0.8)
        found.push_back({period, anchor, fraction, period * static_cast<int64_t>(at[anchor].size())});
    }
    int64_t most = 0;
    for (const Found& f : found) most = std::max(most, f.covered);
    for (const Found& f : found) {  // shortest first
      if (static_cast<double>(f.covered) < 0.9 * static_cast<double>(most)) continue;
      for (int64_t j : at[f.anchor]) iteration_starts_.push_back(where[j]);
      r_.iterations_found = true;
      const SnapshotEvent& first = ev_[iteration_starts_.front()];
      r_.iterations_reason = fmt::format(
          "{} iterations of {} allocations ({:.0f}% of the allocations from the first on repeat one iteration later), "
          "each starting with the allocation of {} at {}",
          iteration_starts_.size(), f.period, 100 * f.fraction, format_bytes(first.size),
          sites_.label(sites_.info(first.stack).site));
      return;
    }
    r_.iterations_reason = candidates.empty()
                               ? "no allocation recurs at a steady spacing through the trace"
                               : "no recurring allocation marks a pattern that repeats through the trace";
  }

  int64_t iteration_of(int64_t event) const {
    const auto it = std::upper_bound(iteration_starts_.begin(), iteration_starts_.end(), event);
    return static_cast<int64_t>(it - iteration_starts_.begin()) - 1;  // -1: before the first
  }

  // Pass 2: the live blocks, grouped at the peak and at each OOM; the segments at the peak reserved;
  // each iteration's figures; the leak sites.
  void pass_live() {
    LiveMap live;
    live.reserve(1024);
    std::unordered_set<uint64_t> allocated_in_trace, segment_made;
    std::map<uint64_t, std::pair<int64_t, bool>> segs;  // address -> size, expandable
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
    // Live when the trace began: blocks the segments still hold that no event allocated, and blocks
    // the trace frees before (or without) allocating them.
    for (const SnapshotSegment& seg : s_.segments) {
      if (seg.device != r_.device) continue;
      if (!segment_made.count(seg.address)) segs[seg.address] = {seg.total_size, seg.expandable};
      for (const SnapshotBlock& b : seg.blocks) {
        if (b.state == BlockState::inactive || allocated_in_trace.count(b.address)) continue;
        live[b.address] = {b.requested, b.stack, -1, seg.stream};
      }
    }
    for (const auto& [addr, b] : freed_first) live.try_emplace(addr, b);
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

  void segments_at_peak(const LiveMap& live, const std::map<uint64_t, std::pair<int64_t, bool>>& segs) {
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

  void oom_at(int64_t i, int64_t a, const LiveMap& live) {
    const SnapshotEvent& e = ev_[i];
    SnapshotOom o;
    o.event = i;
    o.time_us = e.time_us;
    o.requested = e.size;
    o.allocated = a;
    o.reserved = reserved_before(i);
    o.cached = std::max<int64_t>(0, o.reserved - a);
    o.device_free = e.device_free();
    CachingPolicy rounding;
    const int64_t segment = CachingPolicy::allocation_size(rounding.round_size(std::max<int64_t>(e.size, 1)));
    o.shortfall = std::max<int64_t>(0, segment - std::max<int64_t>(0, e.device_free()));
    o.live = group_live(live, sites_, 8);
    o.stack = sites_.label(sites_.info(e.stack).site);
    const int64_t it = iteration_of(i);
    int64_t forward = 0, optimizer = 0, leaked = 0;
    for (const auto& [addr, b] : live) {
      const auto& info = sites_.info(b.stack);
      const int64_t bit = b.event >= 0 && !iteration_starts_.empty() ? iteration_of(b.event) : -2;
      if (info.optimizer)
        optimizer += b.size;
      else if (info.forward && (it < 0 || bit == it))
        forward += b.size;
      if (bit >= 1 && bit < it) leaked += b.size;  // made in an earlier iteration after the first, still live
    }
    oom_facts_.push_back({it, forward, optimizer, leaked});
    r_.ooms.push_back(std::move(o));
  }

  int64_t reserved_before(int64_t i) const {
    // Recomputed from the start (OOMs are few).
    int64_t res = r_.reserved_at_start;
    for (int64_t k = 0; k < i; ++k) {
      if (adds_reserved(ev_[k].action))
        res += ev_[k].size;
      else if (drops_reserved(ev_[k].action))
        res -= ev_[k].size;
    }
    return res;
  }

  void leak(const LiveMap& live) {
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
    // Sites: allocations made in an iteration after the first and before the last (which may be in
    // flight) that are still live at the end.
    const int64_t last = static_cast<int64_t>(its.size()) - 1;
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

  void replays() {
    std::unordered_set<int64_t> streams;
    for (const SnapshotEvent& e : ev_) {
      if (streams.insert(e.stream).second && streams.size() > 64) break;
    }
    if (std::max(r_.peak_allocated, r_.peak_reserved) > (int64_t{1} << 50) || streams.size() > 64) {
      notes_.push_back(
          fmt::format("device {}: more than 1 PiB or 64 streams: the allocator settings were not replayed", r_.device));
      return;
    }
    AllocatorConfig recorded;
    std::string recorded_name = "as recorded";
    if (s_.settings.known) {
      try {
        recorded = parse_allocator_config(s_.settings.conf, "the snapshot's PYTORCH_CUDA_ALLOC_CONF");
      } catch (const Error&) {
        recorded = AllocatorConfig{};
      }
      recorded.expandable_segments = s_.settings.expandable_segments;
      if (s_.settings.max_split_size > 0) recorded.max_split_size = s_.settings.max_split_size;
    }
    if (!recorded.text().empty()) recorded_name += " (" + recorded.text() + ")";
    std::vector<ReplayConfig> configs = {{recorded_name, recorded}};
    if (!recorded.expandable_segments) {
      AllocatorConfig c = recorded;
      c.expandable_segments = true;
      configs.push_back({"expandable_segments:True", c});
    }
    for (int64_t mb : {128, 512}) {
      if (recorded.expandable_segments || recorded.max_split_size == (mb << 20)) continue;
      AllocatorConfig c = recorded;
      c.max_split_size = mb << 20;
      configs.push_back({fmt::format("max_split_size_mb:{}", mb), c});
    }
    const int64_t device = std::max<int64_t>(
        int64_t{1} << 40,
        4 * std::max({r_.peak_allocated, r_.peak_reserved, r_.allocated_at_start + largest_request_}));
    // Independent replays: one thread each.
    std::vector<std::future<std::optional<ReplayOutcome>>> running;
    for (const ReplayConfig& c : configs) {
      running.push_back(std::async(std::launch::async, [this, &c, device] {
        try {
          return std::optional<ReplayOutcome>(replay(ev_, initial_, use_completed_, c.config, device));
        } catch (const std::exception&) {  // a trace the policy cannot follow (it checks its invariants)
          return std::optional<ReplayOutcome>();
        }
      }));
    }
    std::vector<std::optional<ReplayOutcome>> outcomes;
    for (auto& r : running) outcomes.push_back(r.get());
    if (std::any_of(outcomes.begin(), outcomes.end(), [](const auto& o) { return !o.has_value(); })) {
      notes_.push_back(
          fmt::format("device {}: the allocator's policy could not follow the trace (blocks freed that "
                      "it never handed out, or overlapping ones): no replays",
                      r_.device));
      return;
    }
    for (size_t k = 0; k < configs.size(); ++k) {
      const ReplayOutcome& out = *outcomes[k];
      PolicyReplay p{configs[k].name, out.peak_reserved, out.peak_allocated, 0};
      if (!r_.replays.empty()) p.saving = r_.replays.front().peak_reserved - out.peak_reserved;
      r_.replays.push_back(p);
      replay_reserved_at_oom_.push_back(out.reserved_at);
    }
  }

  void oom_levers() {
    for (size_t k = 0; k < r_.ooms.size(); ++k) {
      SnapshotOom& o = r_.ooms[k];
      const OomFacts& f = oom_facts_[k];
      auto add = [&](std::string lever, std::string setting, int64_t bytes, std::string note) {
        o.levers.push_back(
            {std::move(lever), std::move(setting), bytes, bytes >= o.shortfall && bytes > 0, std::move(note)});
      };
      if (r_.leak.detected) {
        add("leak", "free what each iteration leaves behind", f.leaked,
            "live blocks made in earlier iterations (after the first) at the time of the failure");
      }
      if (f.iteration >= 0 && o.allocated > r_.iterations[f.iteration].live_at_start) {
        const int64_t transient = o.allocated - r_.iterations[f.iteration].live_at_start;
        add("micro-batch", "half the micro-batch, twice the accumulation", transient / 2,
            fmt::format("about half of the {} this iteration had added when it failed", format_bytes(transient)));
      }
      if (f.forward > 0) {
        add("activation checkpointing", "checkpoint every layer", f.forward,
            "at most: the live blocks allocated under a module's forward in this iteration; checkpointing keeps "
            "each layer's input only");
      }
      if (f.optimizer > 0) {
        add("optimizer", "adafactor, sgd, or the state sharded across ranks", f.optimizer,
            "at most: the live blocks allocated by torch.optim (its state)");
      }
      for (size_t c = 1; c < r_.replays.size(); ++c) {
        const auto& at = replay_reserved_at_oom_[c];
        const auto& base = replay_reserved_at_oom_[0];
        const auto it = at.find(o.event);
        const auto bt = base.find(o.event);
        if (it == at.end() || bt == base.end()) continue;
        add("allocator settings", r_.replays[c].setting, bt->second - it->second,
            "reserved bytes this setting would have saved by the failure, in the replay of the trace");
      }
      if (o.levers.empty()) {
        add("none found", "", 0, "the snapshot shows no lever's share of the live memory");
      }
    }
  }

  void fragmentation_verdict() {
    const int64_t gap = r_.peak_reserved - r_.peak_allocated;
    std::string v = fmt::format("reserved peaked at {} against {} allocated at its own peak ({} more)",
                                format_bytes(r_.peak_reserved), format_bytes(r_.peak_allocated), format_bytes(gap));
    if (r_.has_history) {
      v += fmt::format(
          "; at the reserved peak, {} lay free inside segments that also held live blocks (inactive "
          "split) and {} in segments with nothing live",
          format_bytes(r_.inactive_split_at_peak), format_bytes(r_.free_segments_at_peak));
    }
    const PolicyReplay* best = nullptr;
    for (size_t c = 1; c < r_.replays.size(); ++c) {
      if (!best || r_.replays[c].saving > best->saving) best = &r_.replays[c];
    }
    if (!r_.replays.empty()) {
      v += fmt::format("; replayed through the allocator's policy as recorded, reserved peaks at {}",
                       format_bytes(r_.replays.front().peak_reserved));
      if (best && best->saving > 0) {
        v += fmt::format(", and with {} at {} (saves {})", best->setting, format_bytes(best->peak_reserved),
                         format_bytes(best->saving));
      } else if (best) {
        v += "; no allocator setting tried lowers it";
      }
    }
    v += fmt::format("; empty_cache() after the last event would return {}", format_bytes(r_.empty_cache_at_end));
    r_.fragmentation = v;
  }

  struct OomFacts {
    int64_t iteration = -1;
    int64_t forward = 0, optimizer = 0, leaked = 0;
  };

  const MemorySnapshot& s_;
  const std::deque<SnapshotEvent>& ev_;
  Sites& sites_;
  const AnalyzeOptions& o_;
  std::vector<std::string>& notes_;
  DeviceAnalysis r_;
  static constexpr int64_t kMaxSum = int64_t{1} << 60;
  bool use_completed_ = true;
  int64_t largest_request_ = 0;
  int64_t segments_event_ = -1;  // when the segments are looked at: at the peak reserved
  std::vector<int64_t> iteration_starts_;
  std::vector<std::pair<uint64_t, LiveBlock>> initial_;  // live when the trace began
  std::vector<OomFacts> oom_facts_;
  std::vector<std::map<int64_t, int64_t>> replay_reserved_at_oom_;
};

nlohmann::json groups_json(const std::vector<SiteGroup>& groups) {
  nlohmann::json out = nlohmann::json::array();
  for (const SiteGroup& g : groups) {
    out.push_back({{"site", g.site}, {"callers", g.callers}, {"bytes", g.bytes}, {"count", g.count}});
  }
  return out;
}

}  // namespace

SnapshotAnalysis analyze_snapshot(const MemorySnapshot& snapshot, const std::string& source,
                                  const AnalyzeOptions& options) {
  SnapshotAnalysis a;
  a.source = source;
  a.settings = snapshot.settings;
  Sites sites(snapshot);
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
    a.devices.push_back(DeviceAnalyzer(snapshot, d, ev, sites, options, a.notes).run());
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

nlohmann::json SnapshotAnalysis::to_json() const {
  nlohmann::json devs = nlohmann::json::array();
  for (const DeviceAnalysis& d : devices) {
    nlohmann::json timeline = nlohmann::json::array();
    for (const TimelineBucket& t : d.timeline) {
      timeline.push_back({{"event", t.first_event},
                          {"time_us", t.time_us},
                          {"allocated_min", t.allocated_min},
                          {"allocated_max", t.allocated_max},
                          {"reserved_max", t.reserved_max}});
    }
    nlohmann::json its = nlohmann::json::array();
    for (const Iteration& i : d.iterations) {
      its.push_back(
          {{"event", i.first_event}, {"time_us", i.time_us}, {"live_at_start", i.live_at_start}, {"peak", i.peak}});
    }
    nlohmann::json segs = nlohmann::json::array();
    for (const SegmentState& s : d.fragmented_segments) {
      segs.push_back({{"address", s.address},
                      {"total_size", s.total},
                      {"allocated", s.allocated},
                      {"inactive_split", s.inactive_split},
                      {"segment_type", s.small ? "small" : "large"}});
    }
    nlohmann::json replays = nlohmann::json::array();
    for (const PolicyReplay& p : d.replays) {
      replays.push_back({{"setting", p.setting},
                         {"peak_reserved", p.peak_reserved},
                         {"peak_allocated", p.peak_allocated},
                         {"saving", p.saving}});
    }
    nlohmann::json ooms = nlohmann::json::array();
    for (const SnapshotOom& o : d.ooms) {
      nlohmann::json levers = nlohmann::json::array();
      for (const OomLever& l : o.levers) {
        levers.push_back(
            {{"lever", l.lever}, {"setting", l.setting}, {"bytes", l.bytes}, {"avoids", l.avoids}, {"note", l.note}});
      }
      ooms.push_back({{"event", o.event},
                      {"time_us", o.time_us},
                      {"requested", o.requested},
                      {"allocated", o.allocated},
                      {"reserved", o.reserved},
                      {"cached", o.cached},
                      {"device_free", o.device_free},
                      {"shortfall", o.shortfall},
                      {"site", o.stack},
                      {"live", groups_json(o.live)},
                      {"levers", levers}});
    }
    devs.push_back({
        {"device", d.device},
        {"events", d.events},
        {"segments", d.segments},
        {"history", d.has_history},
        {"peak",
         {{"allocated", d.peak_allocated},
          {"allocated_event", d.peak_allocated_event},
          {"allocated_time_us", d.peak_allocated_time_us},
          {"reserved", d.peak_reserved},
          {"reserved_event", d.peak_reserved_event},
          {"reserved_time_us", d.peak_reserved_time_us},
          {"live", groups_json(d.live_at_peak)}}},
        {"start", {{"allocated", d.allocated_at_start}, {"reserved", d.reserved_at_start}}},
        {"end", {{"allocated", d.allocated_at_end}, {"reserved", d.reserved_at_end}}},
        {"iterations", {{"found", d.iterations_found}, {"how", d.iterations_reason}, {"list", its}}},
        {"leak", d.leak.to_json()},
        {"fragmentation",
         {{"verdict", d.fragmentation},
          {"inactive_split_at_peak", d.inactive_split_at_peak},
          {"free_segments_at_peak", d.free_segments_at_peak},
          {"segments_at_peak", segs},
          {"empty_cache_returns", d.empty_cache_at_end},
          {"replays", replays},
          {"timeline", timeline}}},
        {"ooms", ooms},
    });
  }
  return {{"source", source},
          {"allocator_settings",
           {{"conf", settings.conf},
            {"expandable_segments", settings.expandable_segments},
            {"max_split_size", settings.max_split_size}}},
          {"devices", devs},
          {"notes", notes}};
}

std::string SnapshotAnalysis::text() const {
  std::string t = fmt::format("headroom analyze: {}\n", source);
  for (const DeviceAnalysis& d : devices) {
    t += fmt::format("\ndevice {}: {} segments, {} trace events\n", d.device, d.segments, d.events);
    t += fmt::format("1. peak allocated {} (event {}), peak reserved {} (event {})\n", format_bytes(d.peak_allocated),
                     d.peak_allocated_event, format_bytes(d.peak_reserved), d.peak_reserved_event);
    t += "   live at the peak, by the code that allocated it:\n";
    for (const SiteGroup& g : d.live_at_peak) {
      t += fmt::format("   {:>12}  {:>6}  {}{}\n", format_bytes(g.bytes), g.count ? std::to_string(g.count) : "",
                       g.site, g.callers.empty() ? "" : "  <- " + g.callers.front());
    }
    t += fmt::format("2. iterations: {}\n", d.iterations_reason);
    if (d.iterations_found) {
      const size_t show = std::min<size_t>(d.iterations.size(), 8);
      for (size_t k = 0; k < show; ++k) {
        t += fmt::format("   iteration {}: live at start {}, peak {}\n", k + 1,
                         format_bytes(d.iterations[k].live_at_start), format_bytes(d.iterations[k].peak));
      }
      if (show < d.iterations.size()) t += fmt::format("   ... {} more\n", d.iterations.size() - show);
      t += fmt::format("   leak: {} — {}\n", d.leak.detected ? "detected" : "none", d.leak.reason);
      for (const LeakSite& s : d.leak.sites) t += "   - " + s.description + "\n";
    }
    t += "10. fragmentation: " + d.fragmentation + "\n";
    for (const PolicyReplay& p : d.replays) {
      t += fmt::format("   replay {}: peak reserved {}{}\n", p.setting, format_bytes(p.peak_reserved),
                       p.saving != 0
                           ? fmt::format(" ({} {})", p.saving > 0 ? "saves" : "costs", format_bytes(std::abs(p.saving)))
                           : "");
    }
    for (const SnapshotOom& o : d.ooms) {
      t += fmt::format(
          "OOM at event {}: asked for {} at {}; {} live, {} reserved ({} cached), device free {}, short by {}\n",
          o.event, format_bytes(o.requested), o.stack, format_bytes(o.allocated), format_bytes(o.reserved),
          format_bytes(o.cached), o.device_free >= 0 ? format_bytes(o.device_free) : "unknown",
          format_bytes(o.shortfall));
      for (const OomLever& l : o.levers) {
        t += fmt::format("   {} ({}): {} — {}; {}\n", l.lever, l.setting, format_bytes(l.bytes),
                         l.avoids ? "would have avoided it" : "not enough", l.note);
      }
    }
  }
  for (const std::string& n : notes) t += "note: " + n + "\n";
  return t;
}

}  // namespace headroom
