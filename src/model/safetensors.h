// Safetensors — Hugging Face's weights format, read and written: an 8-byte little-endian header
// length N, N bytes of JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}, and an optional
// "__metadata__" of strings}), then the tensors' raw little-endian bytes, every byte of which one
// tensor covers (no holes, no overlaps). A file that breaks any of that — truncated, a header that
// lies about offsets or sizes, an unknown dtype — is refused with an Error naming the file and the
// first thing wrong. Writing is atomic (util/atomic_file.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace headroom {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // as the file names it: "F32", "BF16", ...
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte offsets within the data section
};

class SafetensorsFile {
 public:
  // Reads and checks the header (not the data). `what` names the file's origin in errors.
  static SafetensorsFile open(const std::string& path, const std::string& what = "safetensors");

  const std::string& path() const { return path_; }
  // In the order of their offsets.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The entry of `name`, or null.
  const SafetensorsEntry* find(const std::string& name) const;

  // The tensor `name` read from disk into a new cpu tensor of its own dtype.
  at::Tensor load(const std::string& name) const;

 private:
  std::string path_, what_;
  int64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// The file's dtype name of a scalar type ("F32", ...); Error for one safetensors has no name for.
std::string safetensors_dtype(at::ScalarType type);
// The ATen type of a safetensors dtype name ("BF16"); an Error naming the accepted ones otherwise.
at::ScalarType safetensors_scalar_type(const std::string& dtype);

// Writes `tensors` (any device, any layout: written contiguous from the cpu) with `metadata` to
// `path`, atomically. Names must be unique.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {},
                       const std::string& what = "safetensors");

}  // namespace headroom
