#include "device/device.h"

#include <sched.h>
#include <stdlib.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "device/cuda_adapter.h"
#include "util/error.h"

namespace headroom {

c10::Device resolve_device(const std::string& name) {
  if (name == "auto") return cuda_available() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  if (name == "cpu") return c10::Device(c10::kCPU);
  if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
    const int count = cuda_available() ? cuda_device_count() : 0;
    if (count == 0) fail("--device {}: no CUDA device is available here; use --device cpu", name);
    int index = 0;
    if (name != "cuda") {
      const char* begin = name.data() + 5;
      const char* end = name.data() + name.size();
      auto [ptr, ec] = std::from_chars(begin, end, index);
      if (begin == end || ec != std::errc() || ptr != end)
        fail("--device {}: expected cuda:N with N a device index", name);
    }
    if (index < 0 || index >= count) fail("--device {}: only {} CUDA device(s) here (0..{})", name, count, count - 1);
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  fail("--device '{}': accepted: auto, cpu, cuda, cuda:N", name);
}

int cpu_threads_for_run(int64_t requested) {
  if (requested > 0) return static_cast<int>(requested);
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env != nullptr && std::atoi(env) > 0) return std::atoi(env);
  // Once per process: later runs of the same command (the doctor's trials, the planner's timing)
  // would see this process's own load and shrink, and their times would not compare.
  static const int automatic = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    const int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    double load = 0;
    if (getloadavg(&load, 1) != 1) load = 0;
    return std::clamp(static_cast<int>(std::lround(static_cast<double>(cores) - load)), 1, cores);
  }();
  return automatic;
}

std::optional<int64_t> device_memory_available(const c10::Device& device) {
  // On cuda the card's whole memory: what this process's caching allocator keeps cached from earlier
  // runs is its own to reuse, and cudaMemGetInfo counts it as used.
  if (device.is_cuda()) return cuda_device_memory(device.has_index() ? device.index() : 0).total_bytes;
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

}  // namespace headroom
