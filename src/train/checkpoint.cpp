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

#include "util/error.h"
#include "util/json.h"

namespace headroom {
namespace {

constexpr char kMagic[8] = {'H', 'R', 'C', 'K', 'P', 'T', '0', '1'};
constexpr const char* kFormat = "headroom-checkpoint-1";

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("checkpoint: writing '{}' failed: {}", path, std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

}  // namespace

namespace {
CheckpointInfo read_checkpoint(const std::string& dir, const std::vector<NamedTensor>& model,
                               const std::vector<NamedTensor>& optimizer);
}  // namespace

std::string checkpoint_file(const std::string& dir) { return (std::filesystem::path(dir) / "checkpoint.hrc").string(); }

void check_checkpoint_dir(const std::string& dir) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
    fail("--checkpoint '{}' is a file; accepted: a directory (created when missing)", dir);
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("--checkpoint: cannot create directory '{}': {}", dir, ec.message());
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    fail("--checkpoint: cannot write into '{}': {}", dir, std::strerror(errno));
  }
}

void save_checkpoint(const std::string& dir, const CheckpointInfo& info, const std::vector<NamedTensor>& model,
                     const std::vector<NamedTensor>& optimizer) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("--checkpoint: cannot create directory '{}': {}", dir, ec.message());
  const std::string final_path = checkpoint_file(dir);
  const std::string tmp_path = final_path + ".tmp";
  const int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail("--checkpoint: cannot write '{}': {}", tmp_path, std::strerror(errno));
  // Until the rename, a failure closes the descriptor and removes the partial file; the previous
  // checkpoint is untouched either way.
  struct PartialFile {
    int fd;
    std::string path;
    bool done = false;
    ~PartialFile() {
      if (fd >= 0) ::close(fd);
      if (!done) ::unlink(path.c_str());
    }
  } partial{fd, tmp_path};

  nlohmann::json tensors = nlohmann::json::array();
  uint64_t offset = sizeof(kMagic);
  write_all(fd, kMagic, sizeof(kMagic), tmp_path);
  auto write_group = [&](const char* group, const std::vector<NamedTensor>& list) {
    for (const auto& [name, tensor] : list) {
      at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
      const size_t n = t.nbytes();
      write_all(fd, t.data_ptr(), n, tmp_path);
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
  const nlohmann::json footer = {{"format", kFormat},   {"step", info.step},
                                 {"seed", info.seed},   {"total_steps", info.total_steps},
                                 {"model", info.model}, {"tensors", tensors}};
  const std::string text = dump_json(footer);
  const uint64_t length = text.size();
  write_all(fd, text.data(), text.size(), tmp_path);
  write_all(fd, &length, sizeof(length), tmp_path);
  write_all(fd, kMagic, sizeof(kMagic), tmp_path);
  if (::fsync(fd) != 0) fail("checkpoint: flushing '{}' failed: {}", tmp_path, std::strerror(errno));
  partial.fd = -1;
  if (::close(fd) != 0) fail("checkpoint: closing '{}' failed: {}", tmp_path, std::strerror(errno));
  if (std::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    fail("checkpoint: renaming '{}' to '{}' failed: {}", tmp_path, final_path, std::strerror(errno));
  }
  partial.done = true;
  fsync_path(dir, O_RDONLY | O_DIRECTORY);
}

CheckpointInfo load_checkpoint(const std::string& dir, const std::vector<NamedTensor>& model,
                               const std::vector<NamedTensor>& optimizer) {
  try {
    return read_checkpoint(dir, model, optimizer);
  } catch (const nlohmann::json::exception& e) {
    fail("--resume: '{}' is corrupt (its header is malformed: {})", checkpoint_file(dir), e.what());
  }
}

namespace {

CheckpointInfo read_checkpoint(const std::string& dir, const std::vector<NamedTensor>& model,
                               const std::vector<NamedTensor>& optimizer) {
  const std::string path = checkpoint_file(dir);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("--resume: no checkpoint at '{}' (expected a directory written by --checkpoint)", path);
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  char head[8] = {}, tail[8] = {};
  uint64_t length = 0;
  in.seekg(0);
  in.read(head, 8);
  if (!in || std::memcmp(head, kMagic, 8) != 0) fail("--resume: '{}' is not a headroom checkpoint", path);
  if (size < 24) fail("--resume: '{}' is truncated ({} bytes)", path, size);
  in.seekg(static_cast<std::streamoff>(size - 16));
  in.read(reinterpret_cast<char*>(&length), 8);
  in.read(tail, 8);
  if (!in || std::memcmp(tail, kMagic, 8) != 0 || length > size - 24) {
    fail("--resume: '{}' is truncated or corrupt (its end marker is missing)", path);
  }
  std::string text(length, '\0');
  in.seekg(static_cast<std::streamoff>(size - 16 - length));
  in.read(text.data(), static_cast<std::streamsize>(length));
  const auto footer = nlohmann::json::parse(text, nullptr, false);
  if (footer.is_discarded() || footer.value("format", "") != kFormat) {
    fail("--resume: '{}' has an unreadable header (corrupt, or written by another version)", path);
  }

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
    if (n != buffer.nbytes() || off + n > size - 16 - length) fail("--resume: '{}' is corrupt (bad offsets)", path);
    in.seekg(static_cast<std::streamoff>(off));
    in.read(static_cast<char*>(buffer.data_ptr()), static_cast<std::streamsize>(n));
    if (!in) fail("--resume: '{}' is truncated (reading '{}')", path, name);
    if (hex(fnv1a(buffer.data_ptr(), n)) != entry.at("fnv1a")) {
      fail("--resume: '{}' is corrupt: tensor '{}' fails its checksum", path, name);
    }
    target.copy_(buffer);
  }
  CheckpointInfo info;
  info.step = footer.at("step");
  info.seed = footer.at("seed");
  info.total_steps = footer.at("total_steps");
  info.model = footer.at("model");
  return info;
}

}  // namespace

}  // namespace headroom
