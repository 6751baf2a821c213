// NVML, loaded at run time (dlopen of libnvidia-ml.so.1): device memory and this process's memory
// as nvidia-smi reports them. Absent NVML (no driver, a container without it) is not an error: the
// reading says available = false.
#pragma once

#include <cstdint>
#include <string>

namespace headroom {

struct NvmlReading {
  bool available = false;
  std::string why_not;          // when unavailable
  int64_t device_used_bytes = 0;
  int64_t device_total_bytes = 0;
  int64_t process_used_bytes = -1;  // -1: the driver did not list this process
};

NvmlReading nvml_read(int device_index);

}  // namespace headroom
