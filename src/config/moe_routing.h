// MoeRouting — what an estimate assumes about how a mixture of experts routes its tokens.
//   balanced  every expert receives tokens·top_k / experts (the default)
//   worst     the worst case a dropless router allows: top_k experts receive every token
//   skew S    the hottest expert receives S times the balanced share (capped at every token), the
//             rest share what remains: the skew a run measured (`headroom train` reports it)
// The experts' saved activations sum to tokens·top_k rows whatever the routing; what the routing
// changes is the largest expert's transient buffers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace headroom {

struct MoeRouting {
  bool worst = false;
  double skew = 1.0;  // >= 1; 1: balanced

  std::string name() const;  // "balanced", "worst" or the skew, e.g. "1.8"
  bool operator==(const MoeRouting&) const = default;

  // Rows per expert for `rows` tokens routed to `top_k` of `experts` each.
  std::vector<int64_t> loads(int64_t rows, int64_t experts, int64_t top_k) const;
};

// Throws Error naming the accepted values.
MoeRouting parse_moe_routing(const std::string& text);

}  // namespace headroom
