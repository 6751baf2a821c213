#include "device/device.h"

#include <charconv>

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
      if (begin == end || ec != std::errc() || ptr != end) fail("--device {}: expected cuda:N with N a device index", name);
    }
    if (index < 0 || index >= count) fail("--device {}: only {} CUDA device(s) here (0..{})", name, count, count - 1);
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  fail("--device '{}': accepted: auto, cpu, cuda, cuda:N", name);
}

}  // namespace headroom
