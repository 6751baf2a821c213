// The trainer — trains a causal LM per a RunConfig and returns what happened as a value.
//
// Reads top to bottom in trainer.cpp: build the run (train/run.h), resume if asked, then per
// optimizer step: the step under the OOM guard (train/oom_guard.h, which runs train/step.h's five
// phases), its record, the observers (checkpoint, evaluation, metrics, progress:
// train/observers.h). A run that runs out of memory in a way the guard cannot absorb ends there,
// with the diagnosis in TrainResult::oom and the records of the steps before it; the failed step's
// memory is released first. A loss that stops being finite ends it too (TrainResult::diverged; with
// fp16 loss scaling after 5 such steps in a row, which the scaler should have recovered from),
// before the step's checkpoint could overwrite a good one with it. An interrupt (util/interrupt.h)
// ends it after the step in flight, with a checkpoint. Throws Error for bad input only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "memory/leak_detector.h"
#include "memory/oom_report.h"
#include "train/step_record.h"

namespace headroom {

struct TrainSummary {
  int64_t params = 0;
  int64_t trainable_params = 0;  // --finetune: those with gradients and optimizer state
  int64_t steps = 0;  // total optimizer steps completed, resumed ones included
  double final_loss = 0;
  double eval_loss = 0;     // NaN with --eval-rows 0
  double tokens_per_s = 0;  // over the steps this process ran
  int64_t peak_bytes = 0;   // over the steps this process ran
  std::optional<int64_t> peak_reserved_bytes;  // caching allocators: reserved, over the same steps
  std::optional<int64_t> host_bytes;           // --offload optimizer: host memory at its peak, over the same steps
  double seconds = 0;
  // The allocations made during the steps (after the first two) still alive when the run ended, by
  // site (cpu; cuda with RunConfig::leak_origins)
  std::vector<LeakSite> surviving;
  std::string device;
  std::string memory_table;   // MemoryMonitor::summary_table()
  std::string memory_source;  // what the memory figures measure
  // Data-parallel runs (torchrun): this process's rank, the world size, and every rank's peak
  // (gathered at the end; empty for a lone process, or when the run did not end together).
  int rank = 0, ranks = 1;
  std::vector<int64_t> rank_peak_bytes;
  // A mixture of experts: the largest routing skew of the steps (StepRecord::routing_skew).
  std::optional<double> routing_skew;
};

// Training that diverged: the loss (or, without loss scaling, the gradient norm) stopped being a number.
struct Divergence {
  int64_t step = 0;             // the step that ended the run (1-based)
  int64_t since = 0;            // the first of the consecutive non-finite steps
  double loss = 0;              // nan or inf: the loss, or the gradient norm
  std::string message() const;  // one line: the steps, and the likely causes
};

struct TrainResult {
  TrainSummary summary;
  std::vector<StepRecord> steps;       // each step this process completed, in order
  std::optional<OomReport> oom;        // ended out of memory (during setup, or in the step after the last record)
  std::optional<Divergence> diverged;  // ended because the loss was not finite; no checkpoint was written of it
  int interrupted = 0;  // the signal (SIGINT, SIGTERM) that stopped it after its last record, checkpointed

  bool fits() const { return !oom.has_value(); }
  // The median step time after the first (which warms up); the only one if just one; 0 if none.
  double median_step_seconds() const;
  // The live bytes after each step and its transient memory, for the leak detector.
  std::vector<StepLive> live_series() const;
  // The peak when the run fitted; else what was in use at the failure plus the request (a lower bound).
  int64_t peak_or_failure_bytes() const;
};

TrainResult train(const RunConfig& config);

}  // namespace headroom
