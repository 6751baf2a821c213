// Which device a run uses: "cpu", "cuda" (or "cuda:N"), or "auto" (cuda when one is present).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>

namespace headroom {

// Throws Error for an unknown name, or for cuda when no CUDA device is present.
c10::Device resolve_device(const std::string& name);

// The intra-op threads a cpu run uses: `requested` when positive; else OMP_NUM_THREADS when set;
// else the cores this process may use less those the rest of the machine keeps busy (the 1-minute
// load average, read once per process), at least 1. OpenMP threads that spin waiting for a core another process holds
// make a step several times slower than one thread would (two busy runs on two cores: 20 s each
// against 10 s with one thread each).
int cpu_threads_for_run(int64_t requested);

// Memory the device can give a run at most: on cpu the kernel's MemAvailable (/proc/meminfo), on
// cuda the card's total memory; nullopt when it cannot be read.
std::optional<int64_t> device_memory_available(const c10::Device& device);

}  // namespace headroom
