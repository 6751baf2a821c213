#include "config/base_weights.h"

#include "util/error.h"

namespace headroom {

const char* base_weights_name(BaseWeights b) {
  switch (b) {
    case BaseWeights::dense: return "dense";
    case BaseWeights::nf4: return "nf4";
  }
  return "?";
}

BaseWeights parse_base_weights(const std::string& text) {
  for (BaseWeights b : kBaseWeights) {
    if (text == base_weights_name(b)) return b;
  }
  fail("--base-weights '{}': accepted: dense or nf4 (4-bit NormalFloat, with --finetune lora:...)", text);
}

}  // namespace headroom
