// OomReport — a training run that ran out of device memory and could not continue, with the
// diagnosis: where (step, phase), what was asked for, what was in use and of what it consisted.
// The trainer returns it as a value (TrainResult::oom); the CLI prints it and exits with kExitOom.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "memory/memory_monitor.h"
#include "memory/phase.h"

namespace headroom {

struct OomReport {
  int64_t step = 0;  // 1-based
  Phase phase = Phase::idle;
  int64_t requested = -1;  // -1: unknown (cuda reports it only in its message)
  int64_t in_use = 0;
  int64_t budget = -1;             // -1: none
  bool injected = false;           // a fault injected by a test, not a real shortage
  bool during_setup = false;       // allocating the model and optimizer state, before any step
  Breakdown breakdown;             // of in_use, at the failing allocation (during setup: weights = what they need)
  int64_t live_before_step = 0;    // live bytes when the step began
  int64_t live_after_cleanup = 0;  // after the failed step's memory was released
  int64_t micro_batch = 0;         // the micro-batch of the failed attempt
  bool during_update = false;      // in or after the optimizer update: the step could not be re-run
  bool guard_on = true;            // false: --no-guard, the first OOM ended the run
  std::string message;             // the allocator's own one-line message
  std::string advice;              // what would make it fit, when known (composed above the trainer: plan/oom_advice.h)
  // Data-parallel runs: the rank that ran out of memory (-1: a lone process), and whether that was
  // another rank than the one reporting (whose own figures are then not the failure's).
  int rank = -1;
  bool elsewhere = false;

  nlohmann::json to_json() const;
  // Several lines for a person: the facts, the breakdown, the largest category.
  std::string to_text() const;
};

// The size in "Tried to allocate 20.00 MiB" of PyTorch's CUDA OOM message; 0 when absent.
int64_t requested_bytes_of(const std::string& message);

}  // namespace headroom
