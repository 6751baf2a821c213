#include "device/nvml.h"

#include <dlfcn.h>
#include <unistd.h>

#include <mutex>

namespace headroom {
namespace {

// The few NVML types used, as its C ABI defines them (nvml.h is not needed to build).
using nvmlReturn_t = int;
using nvmlDevice_t = void*;
struct nvmlMemory_t {
  unsigned long long total, free, used;
};
struct nvmlProcessInfo_t {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId, computeInstanceId;
};

struct Nvml {
  void* lib = nullptr;
  std::string error;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*handle)(unsigned int, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*processes)(nvmlDevice_t, unsigned int*, nvmlProcessInfo_t*) = nullptr;
};

Nvml& nvml() {
  static Nvml n;
  static std::once_flag once;
  std::call_once(once, [] {
    n.lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (n.lib == nullptr) {
      n.error = "libnvidia-ml.so.1 not found";
      return;
    }
    n.init = reinterpret_cast<decltype(n.init)>(::dlsym(n.lib, "nvmlInit_v2"));
    n.handle = reinterpret_cast<decltype(n.handle)>(::dlsym(n.lib, "nvmlDeviceGetHandleByIndex_v2"));
    n.memory = reinterpret_cast<decltype(n.memory)>(::dlsym(n.lib, "nvmlDeviceGetMemoryInfo"));
    n.processes =
        reinterpret_cast<decltype(n.processes)>(::dlsym(n.lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
    if (!n.init || !n.handle || !n.memory) {
      n.error = "libnvidia-ml.so.1 lacks nvmlInit_v2/nvmlDeviceGetMemoryInfo";
      n.lib = nullptr;
      return;
    }
    if (n.init() != 0) {
      n.error = "nvmlInit failed";
      n.lib = nullptr;
    }
  });
  return n;
}

}  // namespace

NvmlReading nvml_read(int device_index) {
  NvmlReading r;
  Nvml& n = nvml();
  if (n.lib == nullptr) {
    r.why_not = n.error;
    return r;
  }
  nvmlDevice_t dev = nullptr;
  nvmlMemory_t mem{};
  if (n.handle(static_cast<unsigned int>(device_index), &dev) != 0 || n.memory(dev, &mem) != 0) {
    r.why_not = "NVML could not read the device";
    return r;
  }
  r.available = true;
  r.device_used_bytes = static_cast<int64_t>(mem.used);
  r.device_total_bytes = static_cast<int64_t>(mem.total);
  if (n.processes != nullptr) {
    nvmlProcessInfo_t procs[64];
    unsigned int count = 64;
    if (n.processes(dev, &count, procs) == 0) {
      for (unsigned int i = 0; i < count; ++i) {
        if (procs[i].pid == static_cast<unsigned int>(::getpid())) {
          r.process_used_bytes = static_cast<int64_t>(procs[i].usedGpuMemory);
        }
      }
    }
  }
  return r;
}

}  // namespace headroom
