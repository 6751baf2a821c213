// Which device a run uses: "cpu", "cuda" (or "cuda:N"), or "auto" (cuda when one is present).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>

namespace headroom {

// Throws Error for an unknown name, or for cuda when no CUDA device is present.
c10::Device resolve_device(const std::string& name);

// Memory the device can still give: on cpu the kernel's MemAvailable (/proc/meminfo), on cuda the
// card's free memory; nullopt when it cannot be read.
std::optional<int64_t> device_memory_available(const c10::Device& device);

}  // namespace headroom
