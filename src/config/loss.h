// Loss — how the LM head and the cross-entropy are computed (the loss lever): `full` makes the
// whole [tokens × vocab] logits, as a model's own forward does; `chunked` runs the head and the
// loss over chunks of tokens (model/chunked_loss.h), never holding more than a chunk's logits.
// Parsed once from --loss.
#pragma once

#include <cstdint>
#include <string>

namespace headroom {

struct LossSetting {
  bool chunked = false;
  int64_t chunk = 0;  // tokens per chunk; 0: chosen from the shapes (chunk_tokens)

  std::string name() const;  // "full", "chunked" or "chunked:N"
  bool operator==(const LossSetting&) const = default;
};

// Throws Error naming the accepted values.
LossSetting parse_loss(const std::string& text);

// The tokens per chunk a chunked loss uses over `tokens` rows of a `hidden`-wide head with `vocab`
// outputs: the setting's own, else the power of two nearest tokens / ceil(vocab / hidden) (a chunk's
// logits about the size of the hidden states it comes from), at least kMinChunkTokens (each chunk's
// matmul streams the whole head: 8-token chunks kept a 1,024-token Qwen3 run on the cpu in the
// head's matmuls for over 18 minutes)
// and at most `tokens`.
inline constexpr int64_t kMinChunkTokens = 256;
int64_t chunk_tokens(const LossSetting& loss, int64_t tokens, int64_t vocab, int64_t hidden);

}  // namespace headroom
