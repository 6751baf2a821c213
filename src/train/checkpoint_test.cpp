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
  save_checkpoint(dir.path(), {12, 99, 200, "adamw", {{"model_type", "llama"}}}, model, opt);
  auto model2 = tensors(0.0f);
  auto opt2 = std::vector<NamedTensor>{{"a.step", at::zeros({})}};
  const CheckpointInfo info = load_checkpoint(dir.path(), model2, opt2);
  EXPECT_EQ(info.step, 12);
  EXPECT_EQ(info.seed, 99u);
  EXPECT_EQ(info.total_steps, 200);
  EXPECT_EQ(info.optimizer, "adamw");
  EXPECT_EQ(info.model.at("model_type"), "llama");
  EXPECT_TRUE(at::equal(model2[0].tensor, model[0].tensor));
  EXPECT_TRUE(at::equal(model2[1].tensor, model[1].tensor));
  EXPECT_EQ(opt2[0].tensor.item<float>(), 7.0f);
  EXPECT_FALSE(std::filesystem::exists(checkpoint_file(dir.path()) + ".tmp"));
}

TEST(Checkpoint, ACrashMidSaveLeavesThePreviousCheckpointLoadable) {
  // A save writes the .tmp file first; a crash leaves a partial .tmp beside the intact previous file.
  TempDir dir;
  save_checkpoint(dir.path(), {5, 1, 10, "sgd", {}}, tensors(2.0f), {});
  {
    std::ofstream partial(checkpoint_file(dir.path()) + ".tmp", std::ios::binary);
    partial << "HRCKPT02 half a tens";
  }
  auto target = tensors(0.0f);
  EXPECT_EQ(load_checkpoint(dir.path(), target, {}).step, 5);
  EXPECT_TRUE(at::equal(target[0].tensor, tensors(2.0f)[0].tensor));
  save_checkpoint(dir.path(), {6, 1, 10, "sgd", {}}, tensors(3.0f), {});  // the next save replaces the debris
  EXPECT_EQ(load_checkpoint(dir.path(), target, {}).step, 6);
}

TEST(Checkpoint, TruncatedIsRefused) {
  TempDir dir;
  save_checkpoint(dir.path(), {1, 1, 1, "sgd", {}}, tensors(1.0f), {});
  const auto path = checkpoint_file(dir.path());
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size - 40);
  auto target = tensors(0.0f);
  EXPECT_THAT([&] { load_checkpoint(dir.path(), target, {}); }, ThrowsMessage<Error>(HasSubstr("truncated")));
}

TEST(Checkpoint, FlippedByteFailsTheChecksum) {
  TempDir dir;
  save_checkpoint(dir.path(), {1, 1, 1, "sgd", {}}, tensors(1.0f), {});
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
  save_checkpoint(dir.path(), {1, 1, 1, "sgd", {}}, tensors(1.0f), {});
  std::vector<NamedTensor> other = {{"a", at::zeros({3, 5})}, {"b", at::zeros({5})}};
  EXPECT_THAT([&] { load_checkpoint(dir.path(), other, {}); },
              ThrowsMessage<Error>(HasSubstr("tensor 'a' is Float 3x4 but this run's is Float 3x5")));
  std::vector<NamedTensor> renamed = {{"a", at::zeros({3, 4})}, {"c", at::zeros({5})}};
  EXPECT_THAT([&] { load_checkpoint(dir.path(), renamed, {}); },
              ThrowsMessage<Error>(HasSubstr("tensor 'b' that this run does not")));
}

// The footer (step, seed, model, tensor table) is checksummed: editing "step":20 to 10 would
// otherwise resume at step 11 with step 20's weights.
TEST(Checkpoint, AnEditedFooterFailsItsChecksum) {
  TempDir dir;
  save_checkpoint(dir.path(), {20, 7, 40, "adamw", {{"model_type", "llama"}}}, tensors(1.0f), {});
  const auto path = checkpoint_file(dir.path());
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto at = bytes.find("\"step\":20");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 9, "\"step\":10");  // same length: only the checksum can tell
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << bytes;
  }
  auto target = tensors(0.0f);
  EXPECT_THAT([&] { load_checkpoint(dir.path(), target, {}); },
              ThrowsMessage<Error>(HasSubstr("its header (step, seed, model, tensor table) fails its checksum")));
}

TEST(Checkpoint, AFormatOneCheckpointIsStillRead) {
  // The model fixtures of hf_reference_test.cpp were written by format 1 (no footer checksum, no
  // optimizer name); a checkpoint a user made with an older headroom must still resume.
  auto target = std::vector<NamedTensor>{};
  const std::string dir = std::string(HEADROOM_SOURCE_DIR) + "/src/model/testdata/hf/llama";
  std::ifstream in(checkpoint_file(dir), std::ios::binary);
  char head[8] = {};
  in.read(head, 8);
  ASSERT_EQ(std::string(head, 8), "HRCKPT01");
  EXPECT_THAT(
      [&] { load_checkpoint(dir, target, {}); },
      ThrowsMessage<Error>(HasSubstr("it was written for a different model or optimizer")));  // read, then compared
}

TEST(Checkpoint, ADirectoryThatCannotHoldOneIsRefusedBeforeTraining) {
  TempDir dir;
  const std::string file = dir.file("a-file");
  { std::ofstream(file) << "x"; }
  EXPECT_THAT([&] { check_checkpoint_dir(file); }, ThrowsMessage<Error>(HasSubstr("is a file")));
  EXPECT_THAT([&] { check_checkpoint_dir(file + "/below"); }, ThrowsMessage<Error>(HasSubstr("cannot create")));
  check_checkpoint_dir(dir.file("new/nested"));  // created when missing
  EXPECT_TRUE(std::filesystem::is_directory(dir.file("new/nested")));
}

}  // namespace
}  // namespace headroom
