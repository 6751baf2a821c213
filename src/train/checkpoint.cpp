#include "train/checkpoint.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "util/atomic_file.h"
#include "util/error.h"
#include "util/json.h"

namespace headroom {
namespace {

// Format 2: the footer is checksummed too, and names the optimizer.
constexpr char kMagic[8] = {'H', 'R', 'C', 'K', 'P', 'T', '0', '2'};
constexpr char kMagicV1[8] = {'H', 'R', 'C', 'K', 'P', 'T', '0', '1'};
constexpr const char* kFormat = "headroom-checkpoint-2";
constexpr const char* kFormatV1 = "headroom-checkpoint-1";
constexpr uint64_t kTrailer = 24;  // footer length, footer checksum, end marker

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }

}  // namespace

namespace {
CheckpointInfo read_checkpoint(const std::string& path, const std::vector<NamedTensor>& model,
                               const std::vector<NamedTensor>& optimizer);
std::string manifest_file(const std::string& dir) { return (std::filesystem::path(dir) / "manifest.json").string(); }
}  // namespace

std::string checkpoint_file(const std::string& dir, std::optional<CheckpointShard> shard) {
  const std::string name = shard ? fmt::format("rank-{}-of-{}.hrc", shard->rank, shard->ranks) : "checkpoint.hrc";
  return (std::filesystem::path(dir) / name).string();
}

void write_shard_manifest(const std::string& dir, const ShardManifest& m) {
  nlohmann::json j = {
      {"format", "headroom-sharded-checkpoint-1"}, {"ranks", m.ranks}, {"shard", m.shard}, {"step", m.step}};
  if (!m.layout.empty()) j["layout"] = m.layout;
  write_file_atomically(manifest_file(dir), dump_json(j) + "\n", "--checkpoint");
}

std::optional<ShardManifest> read_shard_manifest(const std::string& dir) {
  const std::string path = manifest_file(dir);
  std::ifstream in(path);
  if (!in) return std::nullopt;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("format", "") != "headroom-sharded-checkpoint-1" ||
      !j.contains("ranks") || !j.at("ranks").is_number_integer() || !j.contains("step") ||
      !j.at("step").is_number_integer() || !j.contains("shard") || !j.at("shard").is_string() ||
      (j.contains("layout") && !j.at("layout").is_string())) {
    fail("--resume: '{}' is not a readable sharded-checkpoint manifest (corrupt, or from another version)", path);
  }
  return ShardManifest{j.at("ranks").get<int>(), j.at("shard").get<std::string>(), j.at("step").get<int64_t>(),
                       j.value("layout", "")};
}

void check_checkpoint_dir(const std::string& dir, const std::string& flag) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
    fail("{} '{}' is a file; accepted: a directory (created when missing)", flag, dir);
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("{}: cannot create directory '{}': {}", flag, dir, ec.message());
  if (::access(dir.c_str(), W_OK | X_OK) != 0) fail("{}: cannot write into '{}': {}", flag, dir, std::strerror(errno));
}

void save_checkpoint(const std::string& dir, const CheckpointInfo& info, const std::vector<NamedTensor>& model,
                     const std::vector<NamedTensor>& optimizer, std::optional<CheckpointShard> shard) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("--checkpoint: cannot create directory '{}': {}", dir, ec.message());
  // Until commit(), the previous checkpoint is untouched; a failure removes the partial file.
  AtomicFile file(checkpoint_file(dir, shard), "--checkpoint");
  nlohmann::json tensors = nlohmann::json::array();
  uint64_t offset = sizeof(kMagic);
  file.write(kMagic, sizeof(kMagic));
  auto write_group = [&](const char* group, const std::vector<NamedTensor>& list) {
    for (const auto& [name, tensor] : list) {
      at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
      const size_t n = t.nbytes();
      file.write(t.data_ptr(), n);
      tensors.push_back({{"group", group},
                         {"name", name},
                         {"dtype", std::string(c10::toString(t.scalar_type()))},
                         {"shape", t.sizes().vec()},
                         {"offset", offset},
                         {"bytes", n},
                         {"fnv1a", hex(fnv1a(t.data_ptr(), n))}});
      offset += n;
    }
  };
  write_group("model", model);
  write_group("optimizer", optimizer);
  const nlohmann::json footer = {
      {"format", kFormat},           {"step", info.step},   {"seed", info.seed}, {"total_steps", info.total_steps},
      {"optimizer", info.optimizer}, {"model", info.model}, {"tensors", tensors}};
  const std::string text = dump_json(footer);
  const uint64_t length = text.size(), checksum = fnv1a(text.data(), text.size());
  file.write(text);
  file.write(&length, sizeof(length));
  file.write(&checksum, sizeof(checksum));
  file.write(kMagic, sizeof(kMagic));
  file.commit();
}

CheckpointInfo load_checkpoint(const std::string& dir, const std::vector<NamedTensor>& model,
                               const std::vector<NamedTensor>& optimizer, std::optional<CheckpointShard> shard) {
  const std::string path = checkpoint_file(dir, shard);
  try {
    return read_checkpoint(path, model, optimizer);
  } catch (const nlohmann::json::exception& e) {
    fail("--resume: '{}' is corrupt (its header is malformed: {})", path, e.what());
  }
}

namespace {

// A checkpoint file's verified footer, and where its tensor data ends.
struct Footer {
  nlohmann::json json;
  uint64_t data_end = 0;
};

Footer read_footer(std::ifstream& in, const std::string& path) {
  if (!in) fail("--resume: no checkpoint at '{}' (expected a directory written by --checkpoint)", path);
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  char head[8] = {}, tail[8] = {};
  uint64_t length = 0;
  in.seekg(0);
  in.read(head, 8);
  // Format 1 (older headroom): the same layout without the footer's checksum, nor the optimizer's name.
  const bool v1 = in && std::memcmp(head, kMagicV1, 8) == 0;
  const char* magic = v1 ? kMagicV1 : kMagic;
  const uint64_t trailer = v1 ? 16 : kTrailer;
  if (!in || std::memcmp(head, magic, 8) != 0) fail("--resume: '{}' is not a headroom checkpoint", path);
  if (size < 8 + trailer) fail("--resume: '{}' is truncated ({} bytes)", path, size);
  uint64_t checksum = 0;
  in.seekg(static_cast<std::streamoff>(size - trailer));
  in.read(reinterpret_cast<char*>(&length), 8);
  if (!v1) in.read(reinterpret_cast<char*>(&checksum), 8);
  in.read(tail, 8);
  if (!in || std::memcmp(tail, magic, 8) != 0 || length > size - 8 - trailer) {
    fail("--resume: '{}' is truncated or corrupt (its end marker is missing)", path);
  }
  std::string text(length, '\0');
  in.seekg(static_cast<std::streamoff>(size - trailer - length));
  in.read(text.data(), static_cast<std::streamsize>(length));
  if (!in || (!v1 && fnv1a(text.data(), text.size()) != checksum)) {
    fail("--resume: '{}' is corrupt: its header (step, seed, model, tensor table) fails its checksum", path);
  }
  const auto footer = nlohmann::json::parse(text, nullptr, false);
  if (footer.is_discarded() || footer.value("format", "") != (v1 ? kFormatV1 : kFormat)) {
    fail("--resume: '{}' has an unreadable header (corrupt, or written by another version)", path);
  }
  return {footer, size - trailer - length};
}

CheckpointInfo info_of(const nlohmann::json& footer) {
  CheckpointInfo info;
  info.step = footer.at("step");
  info.seed = footer.at("seed");
  info.total_steps = footer.at("total_steps");
  info.optimizer = footer.value("optimizer", "");
  info.model = footer.at("model");
  return info;
}

CheckpointInfo read_checkpoint(const std::string& path, const std::vector<NamedTensor>& model,
                               const std::vector<NamedTensor>& optimizer) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("--resume: no checkpoint at '{}' (expected a directory written by --checkpoint)", path);
  const Footer f = read_footer(in, path);
  const nlohmann::json& footer = f.json;

  std::map<std::pair<std::string, std::string>, at::Tensor> wanted;
  for (const auto& t : model) wanted[{"model", t.name}] = t.tensor;
  for (const auto& t : optimizer) wanted[{"optimizer", t.name}] = t.tensor;
  if (footer.at("tensors").size() != wanted.size()) {
    fail(
        "--resume: '{}' holds {} tensors but this run's model and optimizer have {}: it was written for a "
        "different model or optimizer",
        path, footer.at("tensors").size(), wanted.size());
  }
  c10::NoGradGuard no_grad;
  for (const auto& entry : footer.at("tensors")) {
    const std::string group = entry.at("group"), name = entry.at("name");
    auto it = wanted.find({group, name});
    if (it == wanted.end()) {
      fail("--resume: '{}' has {} tensor '{}' that this run does not: it was written for a different model", path,
           group, name);
    }
    at::Tensor& target = it->second;
    const auto shape = entry.at("shape").get<std::vector<int64_t>>();
    if (target.sizes().vec() != shape || std::string(c10::toString(target.scalar_type())) != entry.at("dtype")) {
      fail("--resume: '{}' tensor '{}' is {} {} but this run's is {} {}: a different model configuration", path, name,
           entry.at("dtype").get<std::string>(), fmt::join(shape, "x"), c10::toString(target.scalar_type()),
           fmt::join(target.sizes().vec(), "x"));
    }
    at::Tensor buffer = at::empty(shape, target.options().device(at::kCPU));
    const uint64_t off = entry.at("offset"), n = entry.at("bytes");
    if (n != buffer.nbytes() || off + n > f.data_end) {
      fail("--resume: '{}' is corrupt (bad offsets)", path);
    }
    in.seekg(static_cast<std::streamoff>(off));
    in.read(static_cast<char*>(buffer.data_ptr()), static_cast<std::streamsize>(n));
    if (!in) fail("--resume: '{}' is truncated (reading '{}')", path, name);
    if (hex(fnv1a(buffer.data_ptr(), n)) != entry.at("fnv1a")) {
      fail("--resume: '{}' is corrupt: tensor '{}' fails its checksum", path, name);
    }
    target.copy_(buffer);
  }
  return info_of(footer);
}

}  // namespace

CheckpointTensors read_checkpoint_tensors(const std::string& dir, std::optional<CheckpointShard> shard) {
  const std::string path = checkpoint_file(dir, shard);
  try {
    nlohmann::json footer;
    {
      std::ifstream in(path, std::ios::binary);
      if (!in) fail("--resume: no checkpoint at '{}' (expected a directory written by --checkpoint)", path);
      footer = read_footer(in, path).json;
    }
    // Tensors of the shapes and dtypes the footer names, then read (and verified) into them.
    CheckpointTensors out;
    for (const auto& entry : footer.at("tensors")) {
      const std::string dtype = entry.at("dtype");
      std::optional<c10::ScalarType> type;
      for (c10::ScalarType t : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kLong, at::kInt}) {
        if (dtype == c10::toString(t)) type = t;
      }
      if (!type) fail("--resume: '{}' holds a tensor of dtype '{}', which headroom does not write", path, dtype);
      NamedTensor t{entry.at("name"), at::empty(entry.at("shape").get<std::vector<int64_t>>(), at::dtype(*type))};
      (entry.at("group") == "model" ? out.model : out.optimizer).push_back(t);
    }
    out.info = read_checkpoint(path, out.model, out.optimizer);
    return out;
  } catch (const nlohmann::json::exception& e) {
    fail("--resume: '{}' is corrupt (its header is malformed: {})", path, e.what());
  }
}

}  // namespace headroom
