// Fuzzing the checkpoint reader (a file a crash, a disk or a user may have damaged): a real
// checkpoint, mutated — bytes flipped, inserted, deleted, the file cut short, its length fields set
// to extremes — is either read or refused with headroom::Error, never a crash, another exception
// or an allocation the size of a corrupted field.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "testing/temp_dir.h"
#include "train/checkpoint.h"
#include "util/error.h"

namespace headroom {
namespace {

std::vector<NamedTensor> tensors() {
  return {{"embed", at::arange(48, at::kFloat).reshape({6, 8})}, {"bias", at::ones({8}, at::kBFloat16)}};
}

// A valid checkpoint's bytes, made once.
const std::string& valid_checkpoint() {
  static const std::string bytes = [] {
    testing::TempDir dir;
    save_checkpoint(dir.path(), {3, 7, 10, "adamw", {{"model_type", "llama"}}}, tensors(),
                    {{"embed.step", at::full({}, 3.0f)}});
    std::ifstream in(checkpoint_file(dir.path()), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  return bytes;
}

RC_GTEST_PROP(CheckpointFuzz, AMutatedCheckpointIsReadOrRefusedWithAnError, ()) {
  std::string bytes = valid_checkpoint();
  const int edits = *rc::gen::inRange(1, 6);
  for (int e = 0; e < edits && !bytes.empty(); ++e) {
    const size_t at = *rc::gen::inRange<size_t>(0, bytes.size());
    switch (*rc::gen::inRange(0, 5)) {
      case 0: bytes[at] = *rc::gen::arbitrary<char>(); break;
      case 1:
        bytes.insert(at, *rc::gen::container<std::string>(*rc::gen::inRange(1, 16), rc::gen::arbitrary<char>()));
        break;
      case 2: bytes.erase(at, *rc::gen::inRange<size_t>(1, 16)); break;
      case 3: bytes.resize(at); break;
      case 4: {
        // A length or checksum field of the trailer set to an extreme.
        const uint64_t value = *rc::gen::elementOf(std::vector<uint64_t>{0, 1, ~uint64_t{0}, uint64_t{1} << 62});
        if (bytes.size() >= 24) std::memcpy(bytes.data() + bytes.size() - 24 + 8 * *rc::gen::inRange(0, 2), &value, 8);
        break;
      }
    }
  }
  testing::TempDir dir;
  { std::ofstream(checkpoint_file(dir.path()), std::ios::binary) << bytes; }
  auto model = tensors();
  for (auto& t : model) t.tensor = at::zeros_like(t.tensor);
  std::vector<NamedTensor> optimizer = {{"embed.step", at::zeros({})}};
  try {
    const CheckpointInfo info = load_checkpoint(dir.path(), model, optimizer);
    // Read: then it is the checkpoint that was written (a mutation the checksums cannot see would be
    // one that changes nothing they cover).
    RC_ASSERT(info.step == 3);
    RC_ASSERT(at::equal(model[0].tensor, tensors()[0].tensor));
  } catch (const Error&) {
  }
}

}  // namespace
}  // namespace headroom
