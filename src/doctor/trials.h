// Doctor trials — the real runs the diagnosis (doctor/doctor.h) measures, each returning what it saw
// as a value: the configuration's steps under the budget or on the machine's own memory, and the
// levers measured inside a run or in processes of their own — empty-cache and an allocator setting
// (lever 10), a static graph (lever 7), data parallel on local ranks (lever 6). Which trials run,
// and in what order, is the diagnosis's to decide.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "memory/memory_monitor.h"
#include "memory/oom_report.h"
#include "train/trainer.h"

namespace headroom {

struct LeverTrial {
  std::string lever;    // "accumulation", "precision", ...
  std::string setting;  // "micro-batch 8 x accum 2", "bf16-mixed", ...
  bool applies = true;  // false: the note says why not
  bool fits = false;
  int64_t peak_bytes = 0;      // measured (a failed trial: what was in use plus the request), or predicted
  int64_t saving_bytes = 0;    // against the configuration as given
  double step_time_ratio = 0;  // first step's time against the reference's; 0 when not measured
  std::string note;
  bool measured = true;  // false: peak and time are the estimator's and the cost model's predictions
};

// One point of the memory-over-time chart: live bytes entering a phase, its peak, leaving it.
struct PhasePoint {
  int64_t step = 0;
  std::string phase;
  int64_t live_in = 0, peak = 0, live_out = 0;
};

struct TrialRun {
  bool fits = false;
  int64_t peak = 0;
  double first_step_seconds = 0;
  OomReport oom;
  Breakdown breakdown;  // at the last step's peak (fitted runs)
  TrainResult result;
  std::vector<PhasePoint> timeline;
};

// `config`'s first `steps` steps as a trial (config/run_config.h's as_trial), its memory snapshot
// to `snapshot` when not empty. `capped`: under the budget (an OOM ends it early, its figures a
// lower bound); otherwise on the machine's own memory (cpu), so that the peak is the whole step's.
TrialRun run_trial(const RunConfig& config, int64_t steps, bool capped = true, const std::string& snapshot = "");

// Lever 10 with a caching allocator (cuda, cpu caching), inside one run: two steps warm the cache,
// empty_cache() returns what it can, and a third step shows what that cost.
LeverTrial empty_cache_trial(const RunConfig& reference, int64_t budget);

// Lever 10: a caching allocator setting ("expandable_segments:True") on top of the configuration's
// own, its peak reserved bytes against the configuration's `reference_reserved`.
LeverTrial allocator_setting_trial(const RunConfig& reference, const std::string& setting, int64_t reference_reserved,
                                   int64_t budget, double reference_seconds);

// Lever 7 on cuda: the step eager and as a replayed CUDA graph (train/static_graph.h).
LeverTrial static_graph_trial(const RunConfig& reference, int64_t budget);

// Lever 6: `config` (batch and accum per rank, its shard level) on `ranks` local ranks — this
// binary started once per rank (dist/local_ranks.h) — for 2 steps under `budget`, each rank's peak
// against `measured_peak`, the first step's time against `reference_seconds` (0: not timed).
// Throws Error when the ranks cannot be started.
LeverTrial data_parallel_trial(const RunConfig& config, int ranks, bool cuda, int64_t budget, int64_t measured_peak,
                               double reference_seconds);

// The command line (after the binary) of one rank of data_parallel_trial: `headroom train` with
// the trial's settings, written by the field table, its metrics at `metrics`.
std::vector<std::string> local_rank_args(const RunConfig& config, bool cuda, int64_t budget, const std::string& metrics);

}  // namespace headroom
