// Offload — what of a run's state lives in host memory instead of the device's (lever 8's offload):
// the optimizer's state and update (optim/offload.h), the tensors autograd saves in each layer
// (model/activation_offload.h), or both. Parsed once from --offload.
#pragma once

#include <string>

namespace headroom {

enum class Offload {
  none,         // everything on the device
  optimizer,    // the optimizer's state and its update in host memory; parameters and gradients stay
  activations,  // what each layer saves for backward, copied to host memory and back when backward needs it
  both,         // optimizer,activations
};

inline constexpr Offload kOffloads[] = {Offload::none, Offload::optimizer, Offload::activations, Offload::both};

inline bool offloads_optimizer(Offload o) { return o == Offload::optimizer || o == Offload::both; }
inline bool offloads_activations(Offload o) { return o == Offload::activations || o == Offload::both; }

const char* offload_name(Offload offload);
// Throws Error naming the accepted values.
Offload parse_offload(const std::string& text);

}  // namespace headroom
