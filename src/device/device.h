// Which device a run uses: "cpu", "cuda" (or "cuda:N"), or "auto" (cuda when one is present).
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace headroom {

// Throws Error for an unknown name, or for cuda when no CUDA device is present.
c10::Device resolve_device(const std::string& name);

}  // namespace headroom
