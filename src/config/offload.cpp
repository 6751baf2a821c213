#include "config/offload.h"

#include "util/error.h"

namespace headroom {

const char* offload_name(Offload offload) {
  switch (offload) {
    case Offload::none: return "none";
    case Offload::optimizer: return "optimizer";
    case Offload::activations: return "activations";
    case Offload::both: return "optimizer,activations";
  }
  return "?";
}

Offload parse_offload(const std::string& text) {
  for (Offload o : kOffloads) {
    if (text == offload_name(o)) return o;
  }
  if (text == "activations,optimizer") return Offload::both;
  fail("--offload '{}': accepted: none, optimizer, activations or optimizer,activations", text);
}

}  // namespace headroom
