// Step timing — how long a real training step of a configuration takes on this machine, for the
// planner's cost model (plan/cost_model.h), which takes it as a function so that the planner does
// not depend on the trainer.
#pragma once

#include <cstdint>
#include <optional>

#include "config/run_config.h"

namespace headroom {

// Median seconds of `timed` steps of `base` (its model, seq, data and device) at micro-batch `rows`
// in `precision`, after one warm-up step; accumulation 1, no checkpointing, flash attention, no
// budget, no outputs, no OOM guard: nullopt when that shape does not fit the device.
std::optional<double> time_train_step(const RunConfig& base, Precision precision, int64_t rows, int timed);

// How much slower `precision`'s matmuls are than float32's on `device` ("cpu", "cuda:0"): a
// 256 x 256 matmul timed in both, the best of a few runs each. Cheap (milliseconds, even where the
// dtype is emulated), so it can tell a trial that would take minutes (fp16 on a CPU without fp16
// arithmetic) before running it. Remembered per process.
double precision_slowdown(Precision precision, const std::string& device);

// Bytes per second each way between `device` and host memory, as the offload levers copy: 64 MiB
// to the host and back, the best of three each (on cuda, pinned host memory, each copy waited for;
// on the cpu, one buffer into another, as the host pool's copies are). nullopt when the buffers do
// not fit. Remembered per process.
std::optional<double> host_link_bytes_per_second(const std::string& device);

}  // namespace headroom
