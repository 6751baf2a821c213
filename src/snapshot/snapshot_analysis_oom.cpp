// The OOM events of the snapshot analysis (snapshot/device_analyzer.h): what each met, and the
// levers that would have avoided it.
#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "memory/caching_policy.h"
#include "snapshot/device_analyzer.h"
#include "util/size.h"

namespace headroom::snapshot_analysis {

// The OOM at event i, with `a` bytes allocated and `live` the live blocks: its figures, what was
// live by site, and the live bytes each lever could free.
void DeviceAnalyzer::oom_at(int64_t i, int64_t a, const LiveMap& live) {
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

int64_t DeviceAnalyzer::reserved_before(int64_t i) const {
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

// Each OOM's levers in the doctor's order, each with the bytes it frees; one avoids the failure
// when that covers the shortfall.
void DeviceAnalyzer::oom_levers() {
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

}  // namespace headroom::snapshot_analysis
