// Token files — training data already tokenised with the model's own tokenizer: the flat arrays of
// uint16 or uint32 ids that llm.c and nanoGPT write.
//
// llm.c's layout: a header of 256 little-endian int32 — [0] the magic 20240520, [1] the version (1:
// uint16 ids, 2: uint32 ids), [2] the number of ids, [3] the vocabulary size they were made for (0
// when not given; llm.c leaves it 0, tools/tokenize_corpus.py fills it) — then the ids. nanoGPT's train.bin
// has no header: name its width as "uint16:FILE" (or "uint32:FILE"). A file whose header lies (a
// count the file does not hold, an unknown version) or holds an id outside its vocabulary is an
// Error naming the first thing wrong.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace headroom {

inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int64_t kTokenFileHeaderBytes = 256 * 4;

struct TokenFileInfo {
  std::string path;    // the file (the spec without its width prefix)
  int width = 2;       // bytes per id: 2 or 4
  int64_t tokens = 0;  // ids in the file
  int64_t vocab_size = 0;  // from the header; 0: not stated
  int64_t offset = 0;      // where the ids begin
  std::string format() const;  // "llm.c uint16", "headerless uint32", ...
};

// The file's layout from its header (or its size, headerless), checked against its size; reads no
// ids. `spec` is a path or "uint16:PATH" / "uint32:PATH". Errors name `flag`.
TokenFileInfo inspect_token_file(const std::string& spec, const std::string& flag = "--data-tokens");

struct TokenIds {
  at::Tensor raw;      // uint8 [tokens * width]: the ids as stored, little-endian
  int64_t max_id = 0;  // the largest id and its first position, for the vocabulary check
  int64_t max_at = 0;
};

// Reads the ids of a checked file; an id at or beyond the header's vocabulary size is an Error.
TokenIds read_token_ids(const TokenFileInfo& info, const std::string& flag = "--data-tokens");

// The id at `i` of ids stored `width` bytes each (as TokenIds::raw holds them).
inline int64_t token_at(const uint8_t* raw, int width, int64_t i) {
  const uint8_t* p = raw + i * width;
  return width == 1   ? p[0]
         : width == 2 ? static_cast<int64_t>(p[0] | (p[1] << 8))
                      : static_cast<int64_t>(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                                             (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24));
}

}  // namespace headroom
