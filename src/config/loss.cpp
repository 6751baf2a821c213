#include "config/loss.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "util/error.h"

namespace headroom {

std::string LossSetting::name() const {
  if (!chunked) return "full";
  return chunk > 0 ? fmt::format("chunked:{}", chunk) : "chunked";
}

LossSetting parse_loss(const std::string& text) {
  if (text == "full") return {};
  if (text == "chunked") return {true, 0};
  const std::string prefix = "chunked:";
  if (text.rfind(prefix, 0) == 0) {
    const std::string n = text.substr(prefix.size());
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(n.data(), n.data() + n.size(), v);
    if (ec == std::errc() && ptr == n.data() + n.size() && v > 0) return {true, v};
  }
  fail("--loss '{}': accepted: full, chunked (chunk size chosen from the vocabulary) or chunked:TOKENS (a positive "
       "integer)",
       text);
}

int64_t chunk_tokens(const LossSetting& loss, int64_t tokens, int64_t vocab, int64_t hidden) {
  tokens = std::max<int64_t>(tokens, 1);
  if (loss.chunk > 0) return std::min(loss.chunk, tokens);
  const int64_t ratio = (std::max<int64_t>(vocab, 1) + std::max<int64_t>(hidden, 1) - 1) / std::max<int64_t>(hidden, 1);
  const int64_t target = std::max<int64_t>(1, tokens / ratio);
  int64_t p = 1;
  while (p * 2 <= target) p *= 2;
  if (target - p > p * 2 - target) p *= 2;  // the nearer power of two
  return std::min(std::max(p, kMinChunkTokens), tokens);
}

}  // namespace headroom
