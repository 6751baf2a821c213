#include "config/offload.h"

#include "util/error.h"

namespace headroom {

const char* offload_name(Offload offload) {
  switch (offload) {
    case Offload::none: return "none";
    case Offload::optimizer: return "optimizer";
  }
  return "?";
}

Offload parse_offload(const std::string& text) {
  for (Offload o : kOffloads) {
    if (text == offload_name(o)) return o;
  }
  fail("--offload '{}': accepted: none or optimizer", text);
}

}  // namespace headroom
