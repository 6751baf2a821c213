// PickleSource — the bytes of a pickle for the parser (snapshot/pickle_parser.h), from a file read
// in 1 MiB pieces or from memory, with the byte offset of each. Nothing read is trusted for a size:
// take() appends a declared length only as its bytes arrive, so a length larger than the input
// fails as truncated having allocated no more than was read. Each read names the opcode it is for
// and that opcode's offset, for the PickleError (snapshot/pickle_reader.h) that a short input or a
// read error throws. Private to the pickle reader; inline, as it sits in the parser's hot loop.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "snapshot/pickle_reader.h"

namespace headroom {

class PickleSource {
 public:
  static constexpr uint64_t kPiece = uint64_t{1} << 20;  // read size, and the largest piece read at once

  PickleSource(std::FILE* file, std::string_view memory) : file_(file), data_(memory.data()), end_(memory.size()) {}

  uint64_t offset() const { return base_ + pos_; }

  // False at the end of the input.
  bool more() {
    if (pos_ < end_) return true;
    return refill();
  }
  uint8_t byte(uint64_t at, const char* what) {
    if (pos_ >= end_ && !refill()) truncated(at, what);
    return static_cast<uint8_t>(data_[pos_++]);
  }
  // Appends exactly n bytes to out, as they arrive: never reserves more than has been read.
  void take(uint64_t n, std::string& out, uint64_t at, const char* what) {
    while (n > 0) {
      if (pos_ >= end_ && !refill()) truncated(at, what);
      const uint64_t k = std::min<uint64_t>(n, end_ - pos_);
      out.append(data_ + pos_, k);
      pos_ += k;
      n -= k;
    }
  }
  uint64_t little_endian(int bytes, uint64_t at, const char* what) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(byte(at, what)) << (8 * i);
    return v;
  }
  // A text line up to '\n' (protocol 0 arguments), at most `limit` bytes.
  std::string line(uint64_t at, const char* what, size_t limit) {
    std::string s;
    for (;;) {
      const char c = static_cast<char>(byte(at, what));
      if (c == '\n') return s;
      if (s.size() >= limit) throw PickleError(at, fmt::format("{}: argument longer than {} bytes", what, limit));
      s += c;
    }
  }

 private:
  bool refill() {
    if (!file_) return false;
    buffer_.resize(kPiece);
    base_ += end_;
    pos_ = end_ = 0;
    const size_t n = std::fread(buffer_.data(), 1, buffer_.size(), file_);
    if (n == 0 && std::ferror(file_)) throw PickleError(offset(), fmt::format("cannot read: {}", std::strerror(errno)));
    data_ = buffer_.data();
    end_ = n;
    return n > 0;
  }
  [[noreturn]] void truncated(uint64_t at, const char* what) {
    throw PickleError(at, fmt::format("truncated: the input ends at byte {} inside {}", offset(), what));
  }

  std::FILE* file_;
  std::vector<char> buffer_;
  const char* data_;
  uint64_t base_ = 0, pos_ = 0, end_ = 0;
};

}  // namespace headroom
