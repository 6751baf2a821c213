// Offload — what of a run's state lives in host memory instead of the device's (lever 8's offload).
// The machinery is optim/offload.h; this is the setting, parsed once from --offload.
#pragma once

#include <string>

namespace headroom {

enum class Offload {
  none,       // everything on the device
  optimizer,  // the optimizer's state and its update in host memory; parameters and gradients stay
};

inline constexpr Offload kOffloads[] = {Offload::none, Offload::optimizer};

const char* offload_name(Offload offload);
// Throws Error naming the accepted values.
Offload parse_offload(const std::string& text);

}  // namespace headroom
