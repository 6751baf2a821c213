#include "data/text_dataset.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "data/embedded.h"
#include "data/token_file.h"
#include "util/error.h"
#include "util/files.h"

namespace headroom {
namespace {

// SplitMix64: a counter-based generator; good enough to spread window offsets uniformly.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// One byte per token: the corpus stays as small in memory as on disk.
at::Tensor bytes_to_tokens(std::string_view text) {
  auto t = at::empty({static_cast<int64_t>(text.size())}, at::TensorOptions().dtype(at::kByte));
  std::copy(text.begin(), text.end(), reinterpret_cast<char*>(t.data_ptr<uint8_t>()));
  return t;
}

}  // namespace

TextDataset::TextDataset(std::string_view text, std::string origin, double eval_fraction, int64_t seq_len)
    : TextDataset(bytes_to_tokens(text), 1, std::move(origin), eval_fraction, seq_len) {}

TextDataset::TextDataset(const at::Tensor& raw, int width, std::string origin, double eval_fraction, int64_t seq_len)
    : width_(width), seq_len_(seq_len), origin_(std::move(origin)) {
  if (seq_len <= 0) fail("--seq must be positive, got {}", seq_len);
  if (eval_fraction <= 0 || eval_fraction >= 1) fail("eval fraction must be in (0, 1), got {}", eval_fraction);
  const char* unit = width == 1 ? "bytes" : "tokens";
  const int64_t n = raw.numel() / width;
  const auto n_eval = static_cast<int64_t>(static_cast<double>(n) * eval_fraction);
  const int64_t n_train = n - n_eval;
  const int64_t need = seq_len + 1;
  if (n_train < need || n_eval < need) {
    // The smallest corpus whose both splits hold one window of seq + 1 tokens.
    int64_t enough =
        std::max<int64_t>(need, static_cast<int64_t>(std::ceil(static_cast<double>(need) / eval_fraction)) - 2);
    while (enough - static_cast<int64_t>(static_cast<double>(enough) * eval_fraction) < need ||
           static_cast<int64_t>(static_cast<double>(enough) * eval_fraction) < need) {
      ++enough;
    }
    fail(
        "{}: {} {} is too short for --seq {}: its train split ({:.0f}%) holds {} and its eval split (the last "
        "{:.0f}%) {}, and each needs a window of {} (seq + 1); accepted: at least {} {}, or a shorter --seq",
        origin_, n, unit, seq_len, 100 * (1 - eval_fraction), n_train, 100 * eval_fraction, n_eval, need, enough,
        unit);
  }
  train_ = raw.narrow(0, 0, n_train * width).clone();
  eval_ = raw.narrow(0, n_train * width, n_eval * width).clone();
}

TextDataset TextDataset::load(const std::string& path, double eval_fraction, int64_t seq_len) {
  if (path.empty()) return TextDataset(embedded_corpus(), "bundled corpus", eval_fraction, seq_len);
  return TextDataset(read_file(path, "--data"), path, eval_fraction, seq_len);
}

Batch TextDataset::gather(const at::Tensor& split, const std::vector<int64_t>& offsets) const {
  const auto rows = static_cast<int64_t>(offsets.size());
  auto windows = at::empty({rows, seq_len_ + 1}, at::TensorOptions().dtype(at::kLong));
  const uint8_t* src = split.data_ptr<uint8_t>();
  int64_t* dst = windows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i <= seq_len_; ++i) dst[r * (seq_len_ + 1) + i] = token_at(src, width_, offsets[r] + i);
  }
  return {windows.narrow(1, 0, seq_len_), windows.narrow(1, 1, seq_len_)};
}

Batch TextDataset::train_batch(uint64_t seed, int64_t step, int64_t first_row, int64_t rows) const {
  const auto span = static_cast<uint64_t>(train_tokens() - seq_len_);  // valid starts: [0, span)
  std::vector<int64_t> offsets(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t key =
        mix(mix(seed) ^ mix(static_cast<uint64_t>(step) * 0x100000001B3ull + static_cast<uint64_t>(first_row + r)));
    offsets[r] = static_cast<int64_t>(key % span);
  }
  return gather(train_, offsets);
}

std::vector<Batch> TextDataset::eval_batches(int64_t rows, int64_t max_rows) const {
  const int64_t available = (eval_tokens() - 1) / seq_len_;
  const int64_t total = std::min(available, max_rows);
  std::vector<Batch> out;
  for (int64_t first = 0; first < total; first += rows) {
    std::vector<int64_t> offsets;
    for (int64_t r = first; r < std::min(total, first + rows); ++r) offsets.push_back(r * seq_len_);
    out.push_back(gather(eval_, offsets));
  }
  return out;
}

}  // namespace headroom
