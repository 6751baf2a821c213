// Doctor — the systematic diagnosis (headroom's main job): run the configuration, see what
// happens, and come back with an answer for each lever and a plan proven to fit, in time
// proportional to what it has to find out.
//
// In lever order: (1) what happened — the run as configured, under its budget, with the guard off:
// did it run out of memory, in which phase, step and allocation; the breakdown measured next to the
// estimate. If nothing any lever reaches can fit, it stops here and says so. (2) leaks — 8 to 12
// steps of one micro-batch that fits, judged by the leak detector, with the surviving allocations'
// sites. Fragmentation — on cuda, reserved against allocated. (3-6, 8) each lever: accumulation,
// precision, checkpointing, attention, optimizer state (adam and adamw hold the same); its peak,
// saving, step time and whether it fits — on cpu predicted by the estimator (exact there) and run
// for real only where the prediction lies near the budget (all of them with `thorough`, and always
// on cuda); a precision the device emulates is never run. On cuda also empty-cache (what it returns
// and what the next step costs) and (7) static graphs (the step eager against a replayed CUDA
// graph); on cpu both are said plainly not to apply. On cuda the leak check's sites come from the
// caching allocator's own records. Then the planner's recommendation (keeping the configuration's
// numerics when it fits as given, with faster options that change them listed), trained for 2
// steps to prove it fits.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "doctor/trials.h"
#include "estimate/estimator.h"
#include "memory/leak_detector.h"
#include "memory/memory_monitor.h"
#include "plan/planner.h"

namespace headroom {

struct DoctorReport {
  RunConfig config;
  int64_t budget = 0;
  std::string device;
  // (1) what happened
  bool oom = false;
  std::string oom_phase;
  int64_t oom_step = 0;
  std::string oom_text;       // the report's first lines
  int64_t measured_peak = 0;  // of the run as given: the whole step, or (failed, on cuda) at the failure
  bool measured_whole_step = false;
  Breakdown measured;  // at that peak
  Estimate estimate;   // of the run as given
  // (2)
  LeakVerdict leak;
  std::string leak_run;  // what the leak check ran
  std::string fragmentation;
  // (3-8)
  std::string reference;  // what step times are relative to
  std::vector<LeverTrial> levers;
  // the recommendation
  bool plan_found = false;
  Plan plan;                  // when the configuration fits as given (!oom), one that keeps its precision and optimizer
  std::vector<Plan> options;  // then: faster plans that change the precision or the optimizer
  bool plan_verified = false;
  int64_t verified_peak_bytes = 0;
  std::string plan_note;
  std::vector<PhasePoint> timeline;  // of the verification run
  std::string snapshot;              // cuda: PyTorch's memory snapshot of the verification run
  double seconds = 0;

  // The contract (doctor/report_text.cpp): {"oom": {"happened", "phase", "step"}, "measured": {...}, "estimate":
  // {...}, "leak": {"detected", "bytes_per_step", "sites"}, "levers": [...], "plan": {...}}.
  nlohmann::json to_json() const;
  std::string to_text() const;
};

// Runs the diagnosis; `progress` receives a line per stage with the time left (may be null). On
// cuda, a config.memory_snapshot path receives PyTorch's memory snapshot of the recommended plan's
// steps. On cpu the levers are predicted by the estimator and only those whose prediction lies
// near the budget are run (`thorough`: every one, as on cuda). When no combination of levers can
// fit, it says so after the first run, without trying them.
DoctorReport run_doctor(const RunConfig& config, int64_t budget,
                        const std::function<void(const std::string&)>& progress, bool thorough = false);

// The embedded default: a small model on the bundled corpus, on cpu, with a budget too small for
// its naive setting.
RunConfig doctor_default();

}  // namespace headroom
