// The training loop: one function that trains a causal LM per a RunConfig and reports the result.
//
// Reads top to bottom in trainer.cpp: resolve the device, build the model and optimizer, resume if
// asked, then per step: seed dropout from (seed, step), run the micro-batches (forward, loss,
// backward with token weights), clip, update, log, evaluate and checkpoint when due. Progress goes to
// stderr; the metrics JSONL to --metrics. Each step runs inside the MemoryMonitor's phases. Throws
// Error for bad input, and OutOfMemory (memory/oom_report.h) with a diagnosis when a step runs out of
// device memory; the failed step's memory is released first, so live memory is back to its level
// before the step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "memory/leak_detector.h"

namespace headroom {

struct TrainSummary {
  int64_t params = 0;
  int64_t steps = 0;  // total optimizer steps completed, resumed ones included
  double final_loss = 0;
  double eval_loss = 0;     // NaN with --eval-rows 0
  double tokens_per_s = 0;  // over the steps this process ran
  int64_t peak_bytes = 0;   // over the steps this process ran
  double seconds = 0;
  std::vector<double> step_seconds;  // each step this process ran, in order
  // The median of step_seconds after the first (which warms up); the only one if just one; 0 if none.
  double median_step_seconds() const;
  std::vector<StepLive> live_series;  // each step this process ran: live bytes after it, transient
  // The allocations made during the steps (after the first two) still alive when the run ended, by
  // site (cpu; cuda with RunConfig::leak_origins)
  std::vector<LeakSite> surviving;
  std::string device;
  std::string memory_table;   // MemoryMonitor::summary_table()
  std::string memory_source;  // what the memory figures measure
};

TrainSummary train(const RunConfig& config);

}  // namespace headroom
