#include "model/safetensors.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <bit>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "util/atomic_file.h"
#include "util/error.h"

namespace headroom {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors' bytes are little-endian, as this host's");

constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;  // the format's own limit

struct DtypeRow {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeRow kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat},  {"F16", at::kHalf}, {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool},  {"U16", at::kUInt16}, {"U32", at::kUInt32},
    {"U64", at::kUInt64}, {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2},
};

const DtypeRow* dtype_row(const std::string& name) {
  for (const DtypeRow& r : kDtypes) {
    if (name == r.name) return &r;
  }
  return nullptr;
}

std::string accepted_dtypes() {
  std::string out;
  for (const DtypeRow& r : kDtypes) out += (out.empty() ? "" : ", ") + std::string(r.name);
  return out;
}

// One tensor's header entry, checked against the `data_bytes` the file holds after its header.
SafetensorsEntry parse_entry(const std::string& what, const std::string& path, const std::string& name,
                             const nlohmann::json& e, int64_t data_bytes) {
  auto bad = [&](const std::string& why) { fail("{} '{}': tensor '{}': {}", what, path, name, why); };
  if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets")) {
    bad("needs dtype, shape and data_offsets");
  }
  SafetensorsEntry entry;
  entry.name = name;
  if (!e["dtype"].is_string()) bad("dtype must be a string");
  entry.dtype = e["dtype"].get<std::string>();
  const DtypeRow* row = dtype_row(entry.dtype);
  if (!row) bad(fmt::format("dtype '{}' is not supported; accepted: {}", entry.dtype, accepted_dtypes()));
  if (!e["shape"].is_array()) bad("shape must be a list of sizes");
  // The element count in floating point first: a lying shape must not overflow.
  double elements = 1;
  for (const auto& d : e["shape"]) {
    if (!d.is_number_unsigned()) bad("shape must be a list of non-negative integers");
    entry.shape.push_back(static_cast<int64_t>(std::min<uint64_t>(d.get<uint64_t>(), uint64_t{1} << 62)));
    elements *= static_cast<double>(entry.shape.back());
  }
  const auto& offsets = e["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    bad("data_offsets must be two non-negative integers [begin, end]");
  }
  const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
  if (begin > end || end > static_cast<uint64_t>(data_bytes)) {
    bad(
        fmt::format("data_offsets [{}, {}] lie outside the {} bytes of data (the file is truncated, or its header "
                    "is wrong)",
                    begin, end, data_bytes));
  }
  entry.begin = static_cast<int64_t>(begin);
  entry.end = static_cast<int64_t>(end);
  const double expected = elements * static_cast<double>(c10::elementSize(row->type));
  if (expected != static_cast<double>(entry.end - entry.begin)) {
    bad(fmt::format("shape {} of {} needs {:.0f} bytes, its offsets hold {}", e["shape"].dump(), entry.dtype, expected,
                    entry.end - entry.begin));
  }
  return entry;
}

// Every byte of the data belongs to exactly one tensor (`entries` in the order of their offsets).
void check_coverage(const std::string& what, const std::string& path, const std::vector<SafetensorsEntry>& entries,
                    int64_t data_bytes) {
  int64_t at = 0;
  for (const SafetensorsEntry& e : entries) {
    if (e.begin != at) {
      fail(
          "{} '{}': tensor '{}' starts at byte {} of the data, where {} was expected (tensors overlap or leave a "
          "hole)",
          what, path, e.name, e.begin, at);
    }
    at = e.end;
  }
  if (at != data_bytes) {
    fail("{} '{}': the tensors cover {} bytes of data, the file holds {} (truncated, or trailing bytes)", what, path,
         at, data_bytes);
  }
}

}  // namespace

at::ScalarType safetensors_scalar_type(const std::string& dtype) {
  const DtypeRow* row = dtype_row(dtype);
  if (row == nullptr) fail("safetensors dtype '{}' is not supported; accepted: {}", dtype, accepted_dtypes());
  return row->type;
}

std::string safetensors_dtype(at::ScalarType type) {
  for (const DtypeRow& r : kDtypes) {
    if (r.type == type) return r.name;
  }
  fail("safetensors has no dtype for {}; accepted: {}", c10::toString(type), accepted_dtypes());
}

SafetensorsFile SafetensorsFile::open(const std::string& path, const std::string& what) {
  SafetensorsFile f;
  f.path_ = path;
  f.what_ = what;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) fail("{} '{}': not a readable file", what, path);
  const int64_t size = static_cast<int64_t>(st.st_size);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{} '{}': cannot open it", what, path);
  uint64_t n = 0;
  if (size < 8 || !in.read(reinterpret_cast<char*>(&n), 8)) {
    fail("{} '{}': truncated: {} bytes, not even the 8-byte header length", what, path, size);
  }
  if (n > static_cast<uint64_t>(std::min(kMaxHeaderBytes, size - 8))) {
    fail("{} '{}': the header claims {} bytes, but the file has {} after the length (and the format allows at most "
         "100 MiB)",
         what, path, n, size - 8);
  }
  std::string text(static_cast<size_t>(n), '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(n))) fail("{} '{}': cannot read its header", what, path);
  const nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) fail("{} '{}': its header is not a JSON object", what, path);
  f.data_start_ = 8 + static_cast<int64_t>(n);
  const int64_t data_bytes = size - f.data_start_;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") {
      if (!e.is_object()) fail("{} '{}': __metadata__ must be an object of strings", what, path);
      for (const auto& [k, v] : e.items()) {
        if (!v.is_string()) fail("{} '{}': __metadata__.{} must be a string", what, path, k);
        f.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    f.entries_.push_back(parse_entry(what, path, name, e, data_bytes));
  }
  std::sort(f.entries_.begin(), f.entries_.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.begin < b.begin || (a.begin == b.begin && a.end < b.end); });
  check_coverage(what, path, f.entries_, data_bytes);
  return f;
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  for (const SafetensorsEntry& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

at::Tensor SafetensorsFile::load(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  if (!e) fail("{} '{}': no tensor '{}'", what_, path_, name);
  at::Tensor t = at::empty(e->shape, at::TensorOptions().dtype(dtype_row(e->dtype)->type));
  std::ifstream in(path_, std::ios::binary);
  in.seekg(data_start_ + e->begin);
  if (!in || !in.read(static_cast<char*>(t.data_ptr()), e->end - e->begin)) {
    fail("{} '{}': cannot read tensor '{}' (the file changed or is truncated)", what_, path_, name);
  }
  return t;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata, const std::string& what) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  std::set<std::string> names;
  int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name == "__metadata__" || !names.insert(name).second) {
      fail("{} '{}': tensor name '{}' is used twice or reserved", what, path, name);
    }
    at::Tensor cpu = tensor.detach().to(at::kCPU).contiguous();
    const int64_t bytes = static_cast<int64_t>(cpu.nbytes());
    header[name] = {{"dtype", safetensors_dtype(cpu.scalar_type())},
                    {"shape", cpu.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(cpu));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const uint64_t n = text.size();
  AtomicFile out(path, what);
  out.write(&n, 8);
  out.write(text);
  for (const at::Tensor& t : data) out.write(t.data_ptr(), t.nbytes());
  out.commit();
}

}  // namespace headroom
