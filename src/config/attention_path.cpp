#include "config/attention_path.h"

#include "util/error.h"

namespace headroom {

const char* attention_path_name(AttentionPath path) { return path == AttentionPath::flash ? "flash" : "math"; }

AttentionPath parse_attention_path(const std::string& text) {
  if (text == "flash") return AttentionPath::flash;
  if (text == "math") return AttentionPath::math;
  fail("--attention '{}': accepted: flash (fused scaled_dot_product_attention), math (explicit softmax)", text);
}

}  // namespace headroom
