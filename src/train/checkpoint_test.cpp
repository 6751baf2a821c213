#include "train/checkpoint.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "testing/temp_dir.h"
#include "util/error.h"

namespace headroom {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;
using ::testing::ThrowsMessage;

std::vector<NamedTensor> tensors(float base) {
  return {{"a", at::full({3, 4}, base)}, {"b", at::arange(5, at::kFloat) + base}};
}

TEST(Checkpoint, RoundTripsTensorsAndInfo) {
  TempDir dir;
  auto model = tensors(1.5f);
  auto opt = std::vector<NamedTensor>{{"a.step", at::full({}, 7.0f)}};
  save_checkpoint(dir.path(), {12, 99, 200, {{"model_type", "llama"}}}, model, opt);
  auto model2 = tensors(0.0f);
  auto opt2 = std::vector<NamedTensor>{{"a.step", at::zeros({})}};
  const CheckpointInfo info = load_checkpoint(dir.path(), model2, opt2);
  EXPECT_EQ(info.step, 12);
  EXPECT_EQ(info.seed, 99u);
  EXPECT_EQ(info.total_steps, 200);
  EXPECT_EQ(info.model.at("model_type"), "llama");
  EXPECT_TRUE(at::equal(model2[0].tensor, model[0].tensor));
  EXPECT_TRUE(at::equal(model2[1].tensor, model[1].tensor));
  EXPECT_EQ(opt2[0].tensor.item<float>(), 7.0f);
  EXPECT_FALSE(std::filesystem::exists(checkpoint_file(dir.path()) + ".tmp"));
}

TEST(Checkpoint, ACrashMidSaveLeavesThePreviousCheckpointLoadable) {
  // A save writes the .tmp file first; a crash leaves a partial .tmp beside the intact previous file.
  TempDir dir;
  save_checkpoint(dir.path(), {5, 1, 10, {}}, tensors(2.0f), {});
  {
    std::ofstream partial(checkpoint_file(dir.path()) + ".tmp", std::ios::binary);
    partial << "HRCKPT01 half a tens";
  }
  auto target = tensors(0.0f);
  EXPECT_EQ(load_checkpoint(dir.path(), target, {}).step, 5);
  EXPECT_TRUE(at::equal(target[0].tensor, tensors(2.0f)[0].tensor));
  save_checkpoint(dir.path(), {6, 1, 10, {}}, tensors(3.0f), {});  // the next save replaces the debris
  EXPECT_EQ(load_checkpoint(dir.path(), target, {}).step, 6);
}

TEST(Checkpoint, TruncatedIsRefused) {
  TempDir dir;
  save_checkpoint(dir.path(), {1, 1, 1, {}}, tensors(1.0f), {});
  const auto path = checkpoint_file(dir.path());
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size - 40);
  auto target = tensors(0.0f);
  EXPECT_THAT([&] { load_checkpoint(dir.path(), target, {}); }, ThrowsMessage<Error>(HasSubstr("truncated")));
}

TEST(Checkpoint, FlippedByteFailsTheChecksum) {
  TempDir dir;
  save_checkpoint(dir.path(), {1, 1, 1, {}}, tensors(1.0f), {});
  {
    std::fstream f(checkpoint_file(dir.path()), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8 + 5);  // inside tensor 'a'
    f.put('\x7f');
  }
  auto target = tensors(0.0f);
  EXPECT_THAT([&] { load_checkpoint(dir.path(), target, {}); },
              ThrowsMessage<Error>(HasSubstr("tensor 'a' fails its checksum")));
}

TEST(Checkpoint, ForeignFileAndMissingDirectoryAreRefused) {
  TempDir dir;
  {
    std::ofstream f(checkpoint_file(dir.path()));
    f << "PK\x03\x04 this is a zip, not ours";
  }
  auto target = tensors(0.0f);
  EXPECT_THAT([&] { load_checkpoint(dir.path(), target, {}); },
              ThrowsMessage<Error>(HasSubstr("is not a headroom checkpoint")));
  EXPECT_THAT([&] { load_checkpoint(dir.file("nope"), target, {}); },
              ThrowsMessage<Error>(HasSubstr("no checkpoint at")));
}

TEST(Checkpoint, ADifferentModelIsRefused) {
  TempDir dir;
  save_checkpoint(dir.path(), {1, 1, 1, {}}, tensors(1.0f), {});
  std::vector<NamedTensor> other = {{"a", at::zeros({3, 5})}, {"b", at::zeros({5})}};
  EXPECT_THAT([&] { load_checkpoint(dir.path(), other, {}); },
              ThrowsMessage<Error>(HasSubstr("tensor 'a' is Float 3x4 but this run's is Float 3x5")));
  std::vector<NamedTensor> renamed = {{"a", at::zeros({3, 4})}, {"c", at::zeros({5})}};
  EXPECT_THAT([&] { load_checkpoint(dir.path(), renamed, {}); },
              ThrowsMessage<Error>(HasSubstr("tensor 'b' that this run does not")));
}

}  // namespace
}  // namespace headroom
