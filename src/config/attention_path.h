// AttentionPath — how attention is computed (a lever: the memory of the score matrix).
//   flash  at::scaled_dot_product_attention, a fused kernel that never materialises the T x T scores
//          when it can avoid it
//   math   the textbook path, which keeps the B x H x T x T scores and probabilities for backward
#pragma once

#include <string>

namespace headroom {

enum class AttentionPath { flash, math };

const char* attention_path_name(AttentionPath path);
// Throws Error naming the accepted values.
AttentionPath parse_attention_path(const std::string& text);

}  // namespace headroom
