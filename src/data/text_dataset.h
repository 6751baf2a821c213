// TextDataset — a corpus of tokens, split into train and held-out eval, with batches that are a pure
// function of (seed, step, row).
//
// Tokens: a text's bytes (token = byte value, vocabulary 256), so that any text file works and no
// vocabulary file is needed; or the model's own ids from a token file (data/token_file.h), held as
// the file stores them (2 or 4 bytes each). Train row r of step s starts at an offset drawn from a counter-based
// hash of (seed, s, r): the data a step sees does not depend on how its global batch is split into
// micro-batches, nor on what ran before — which makes resume and OOM re-splitting exact.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace headroom {

inline constexpr int64_t kByteVocabulary = 256;

struct Batch {
  at::Tensor inputs;   // [B, T] int64
  at::Tensor targets;  // [B, T] int64, inputs shifted by one
  int64_t tokens() const { return inputs.numel(); }
};

class TextDataset {
 public:
  // `eval_fraction` of the text (its tail) is held out. Throws Error when either split is too short
  // for one window of `seq_len + 1` bytes.
  TextDataset(std::string_view text, std::string origin, double eval_fraction, int64_t seq_len);
  // Ids stored `width` bytes each, little-endian, in a uint8 tensor (TokenIds::raw).
  TextDataset(const at::Tensor& raw, int width, std::string origin, double eval_fraction, int64_t seq_len);

  // The bundled corpus (data/corpus.txt), or the file at `path` when it is not empty.
  static TextDataset load(const std::string& path, double eval_fraction, int64_t seq_len);

  // Rows [first_row, first_row + rows) of step `step`'s global batch.
  Batch train_batch(uint64_t seed, int64_t step, int64_t first_row, int64_t rows) const;

  // Up to `max_rows` non-overlapping windows of the eval split, in order, in batches of `rows`.
  std::vector<Batch> eval_batches(int64_t rows, int64_t max_rows) const;

  int64_t train_tokens() const { return train_.numel() / width_; }
  int64_t eval_tokens() const { return eval_.numel() / width_; }
  int width() const { return width_; }  // bytes per token as held
  int64_t seq_len() const { return seq_len_; }
  const std::string& origin() const { return origin_; }

 private:
  Batch gather(const at::Tensor& split, const std::vector<int64_t>& offsets) const;

  at::Tensor train_;  // uint8: the tokens' bytes, width_ each
  at::Tensor eval_;
  int width_ = 1;
  int64_t seq_len_;
  std::string origin_;
};

}  // namespace headroom
