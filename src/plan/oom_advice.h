// OOM advice — what would let a step that ran out of memory fit, composed from what held the memory
// when it failed (the trainer's OomReport) and, when there is a budget, the estimator's predicted
// peak for each lever of the lever table (plan/levers.h) at micro-batch 1. The trainer only
// reports; this layer, above it, advises.
#pragma once

#include <string>

#include "config/run_config.h"
#include "memory/oom_report.h"

namespace headroom {

// One paragraph: "micro-batch 1 does not fit either; levers that reduce this step's memory: ...;
// by the estimator, at micro-batch 1 with 40 MiB of budget: --optimizer adafactor 33.1 MiB (fits),
// ...". `config` is the run that failed.
std::string oom_advice(const OomReport& report, const RunConfig& config);

}  // namespace headroom
