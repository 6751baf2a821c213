// Leak detection (judge_growth, leak_sites) — does memory grow from step to step (lever 2), and
// what is it made of?
//
// The verdict comes from the live bytes after each step: the warm-up steps are dropped (the first
// optimizer step allocates state, autocast and the allocator warm up), then a robust slope
// (Theil-Sen: the median of the slopes between every pair of steps) and a monotonicity test (the
// fraction of steps that did not shrink) decide. The threshold is relative to the step's transient
// memory (its peak above what it started with): growth below 1% of it per step is noise, not a leak,
// however steady. Attribution uses the allocator's own records (cpu: the budget allocator's; cuda:
// the caching allocator's, tagged through MemoryProbe::record_origins): the allocations still alive that
// were made inside a step after the warm-up — which a step that releases what it allocated leaves
// none of — grouped by phase and size: "8 allocations of 256 KiB created during forward of every
// step and never freed".
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memory/budget_allocator.h"

namespace headroom {

struct StepLive {
  int64_t step = 0;        // 1-based
  int64_t live_after = 0;  // bytes live when the step ended
  int64_t transient = 0;   // its peak minus the live bytes it started with
};

struct LeakSite {
  std::string phase;
  int64_t bytes = 0;        // of each allocation
  int64_t count = 0;        // alive now
  int64_t steps = 0;        // distinct steps that made them
  std::string origin;       // where they were made, when the allocator was told (a Python file:line)
  std::string description;  // "8 allocations of 256 KiB created during forward of every step and never freed"
};

struct LeakVerdict {
  bool detected = false;
  double bytes_per_step = 0;  // robust slope
  double monotonic = 0;       // fraction of step-to-step changes that were not decreases
  int64_t steps_used = 0;
  std::string reason;
  std::vector<LeakSite> sites;     // largest first
  nlohmann::json to_json() const;  // {"detected", "bytes_per_step", "sites": [...], "reason"}
};

struct LeakOptions {
  int64_t warmup_steps = 2;
  double relative_threshold = 0.01;  // of the median transient, per step
  double min_monotonic = 0.8;
  int64_t min_steps = 4;  // after warm-up
};

// The verdict on the live-bytes series alone.
LeakVerdict judge_growth(const std::vector<StepLive>& steps, const LeakOptions& options = {});

// Names an allocation record's origin id (BudgetAllocator::set_origin_source); "" for none.
using OriginName = std::function<std::string(uint32_t origin)>;

// Groups the `live` allocations made in 0-based steps [warmup_steps, last_step) into sites, by
// phase, size and (with `origin_name`) where they were made: after a run, last_step is the number
// of steps run (every step has released what it should); while a step runs, its index, so that its
// work in progress is not counted.
std::vector<LeakSite> leak_sites(const std::vector<LiveAllocation>& live, int64_t warmup_steps, int64_t last_step,
                                 const OriginName& origin_name = nullptr);

}  // namespace headroom
