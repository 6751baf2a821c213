// StepRecord — what one optimizer step did: its loss, shape, time and memory. The trainer returns
// them (TrainResult::steps), the metrics log writes them (train/metrics_log.h documents the fields
// as written), the doctor reads them.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "memory/memory_monitor.h"

namespace headroom {

struct StepRecord {
  int64_t step = 0;  // 1-based
  double loss = 0;
  int64_t tokens = 0;           // of the global batch (every rank's, in a data-parallel run)
  std::optional<int> rank;      // data-parallel runs: the rank whose memory this record measures
  double seconds = 0;
  int64_t peak_bytes = 0;
  int64_t live_bytes = 0;  // after the step
  // A caching allocator's (cuda; cpu with --allocator caching): reserved after the step, the step's
  // highest, and the most free bytes stranded inside split segments.
  std::optional<int64_t> reserved_bytes, peak_reserved_bytes, peak_inactive_split_bytes;
  // --offload optimizer: host memory at its peak in the step (cpu: the host pool's; cuda: the
  // optimizer's host tensors).
  std::optional<int64_t> host_peak_bytes;
  double lr = 0;
  double grad_norm = 0;
  int64_t batch = 0;  // micro-batch the step ran with
  int64_t accum = 0;
  int64_t oom_recoveries = 0;
  StepMemory memory;  // per phase: live in and out, peak, breakdown at the peak
  bool skipped = false;
  std::optional<double> loss_scale;
  std::optional<double> eval_loss;
  // A mixture of experts: the most tokens any expert received in the step, relative to a balanced
  // share (1: balanced) — what `--moe-routing` takes to estimate with the skew this run had.
  std::optional<double> routing_skew;

  // One line of the --metrics file (train/metrics_log.h documents the fields).
  nlohmann::json to_json() const;

  // The step's peak above what was live when it began (what the leak detector calls transient).
  int64_t transient_bytes() const { return peak_bytes - memory.phases[0].live_in; }
};

}  // namespace headroom
