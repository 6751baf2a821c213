#include "data/token_file.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <array>
#include <filesystem>
#include <fstream>

#include "util/error.h"

namespace headroom {

std::string TokenFileInfo::format() const {
  return fmt::format("{} uint{}", offset > 0 ? "llm.c" : "headerless", width * 8);
}

TokenFileInfo inspect_token_file(const std::string& spec, const std::string& flag) {
  TokenFileInfo info;
  info.path = spec;
  bool headerless = false;
  for (const auto& [prefix, width] : {std::pair<std::string, int>{"uint16:", 2}, {"uint32:", 4}}) {
    if (spec.rfind(prefix, 0) == 0) {
      info.path = spec.substr(prefix.size());
      info.width = width;
      headerless = true;
    }
  }
  std::error_code ec;
  if (!std::filesystem::is_regular_file(info.path, ec)) {
    fail("{} '{}': no such file; accepted: an llm.c token file, or uint16:FILE / uint32:FILE for a headerless one",
         flag, info.path);
  }
  const auto size = static_cast<int64_t>(std::filesystem::file_size(info.path, ec));
  if (ec) fail("{} '{}': cannot read its size ({})", flag, info.path, ec.message());
  if (headerless) {
    if (size == 0 || size % info.width != 0) {
      fail("{} '{}': {} bytes is not a whole number of uint{} ids", flag, info.path, size, info.width * 8);
    }
    info.tokens = size / info.width;
    return info;
  }
  std::array<int32_t, 256> header{};
  std::ifstream in(info.path, std::ios::binary);
  if (size < kTokenFileHeaderBytes ||
      !in.read(reinterpret_cast<char*>(header.data()), static_cast<std::streamsize>(kTokenFileHeaderBytes))) {
    fail("{} '{}': {} bytes is shorter than llm.c's 1024-byte header; for a headerless file of ids (nanoGPT's "
         "train.bin) say its width: uint16:{} or uint32:{}",
         flag, info.path, size, info.path, info.path);
  }
  if (header[0] != kTokenFileMagic) {
    fail("{} '{}': no llm.c header (its first int32 is {}, not {}); for a headerless file of ids (nanoGPT's "
         "train.bin) say its width: uint16:{} or uint32:{}",
         flag, info.path, header[0], kTokenFileMagic, info.path, info.path);
  }
  if (header[1] != 1 && header[1] != 2) {
    fail("{} '{}': llm.c header version {}; accepted: 1 (uint16 ids) or 2 (uint32 ids)", flag, info.path, header[1]);
  }
  info.width = header[1] == 1 ? 2 : 4;
  info.offset = kTokenFileHeaderBytes;
  info.tokens = header[2];
  info.vocab_size = header[3];
  if (info.tokens <= 0 || info.vocab_size < 0) {
    fail("{} '{}': the header gives {} ids and vocabulary size {}; accepted: a positive count, a size of 0 (not "
         "stated) or more",
         flag, info.path, info.tokens, info.vocab_size);
  }
  if (const int64_t expect = info.offset + info.tokens * info.width; expect != size) {
    fail("{} '{}': the header says {} uint{} ids ({} bytes with the header), the file has {} bytes ({})", flag,
         info.path, info.tokens, info.width * 8, expect, size, size < expect ? "truncated?" : "trailing data");
  }
  return info;
}

TokenIds read_token_ids(const TokenFileInfo& info, const std::string& flag) {
  TokenIds ids;
  ids.raw = at::empty({info.tokens * info.width}, at::TensorOptions().dtype(at::kByte));
  std::ifstream in(info.path, std::ios::binary);
  in.seekg(info.offset);
  if (!in.read(reinterpret_cast<char*>(ids.raw.data_ptr<uint8_t>()), static_cast<std::streamsize>(ids.raw.numel()))) {
    fail("{} '{}': could not read its {} ids (the file changed while read?)", flag, info.path, info.tokens);
  }
  const uint8_t* raw = ids.raw.data_ptr<uint8_t>();
  for (int64_t i = 0; i < info.tokens; ++i) {
    const int64_t id = token_at(raw, info.width, i);
    if (id > ids.max_id) {
      ids.max_id = id;
      ids.max_at = i;
    }
  }
  if (info.vocab_size > 0 && ids.max_id >= info.vocab_size) {
    fail("{} '{}': id {} at position {} is outside the header's vocabulary of {} (a corrupt file?)", flag, info.path,
         ids.max_id, ids.max_at, info.vocab_size);
  }
  return ids;
}

}  // namespace headroom
