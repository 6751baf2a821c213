#include "config/checkpoint_policy.h"

#include <charconv>

#include "util/error.h"

namespace headroom {

std::string CheckpointPolicy::name() const {
  switch (kind) {
    case Kind::none: return "none";
    case Kind::selective: return "selective";
    case Kind::every: return "every:" + std::to_string(every);
    case Kind::full: return "full";
    case Kind::ops: return "ops";
  }
  return "?";
}

CheckpointPolicy parse_checkpoint_policy(const std::string& text) {
  if (text == "none") return CheckpointPolicy::none();
  if (text == "selective") return CheckpointPolicy::selective();
  if (text == "full") return CheckpointPolicy::full();
  if (text == "ops") return CheckpointPolicy::ops();
  if (text.rfind("every:", 0) == 0) {
    int64_t k = 0;
    const char* end = text.data() + text.size();
    const auto [ptr, ec] = std::from_chars(text.data() + 6, end, k);
    if (ec == std::errc() && ptr == end && k >= 1) return CheckpointPolicy::every_kth(k);
  }
  fail(
      "--checkpointing '{}': accepted: none, selective (attention only), full (every layer), every:K "
      "(layers 0, K, 2K, ...; K >= 1), ops (per-op: every second matmul and attention kept, the rest recomputed)",
      text);
}

}  // namespace headroom
