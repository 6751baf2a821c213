// Token files as llm.c and nanoGPT write them, built here byte by byte: the ids come back as the
// dataset's tokens (uint16 and uint32, with and without the header), and every lie a file can tell
// is refused naming it.
#include "data/token_file.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <fstream>
#include <vector>

#include "data/text_dataset.h"
#include "testing/temp_dir.h"
#include "util/error.h"

namespace headroom {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

// llm.c's header (magic, version, count, vocabulary) and then the ids, little-endian.
void write_llmc(const std::string& path, int32_t version, const std::vector<uint32_t>& ids, int32_t vocab,
                int64_t count = -1) {
  std::array<int32_t, 256> header{};
  header[0] = kTokenFileMagic;
  header[1] = version;
  header[2] = static_cast<int32_t>(count >= 0 ? count : static_cast<int64_t>(ids.size()));
  header[3] = vocab;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), sizeof(header));
  for (uint32_t id : ids) {
    const unsigned char bytes[4] = {static_cast<unsigned char>(id), static_cast<unsigned char>(id >> 8),
                                    static_cast<unsigned char>(id >> 16), static_cast<unsigned char>(id >> 24)};
    out.write(reinterpret_cast<const char*>(bytes), version == 1 ? 2 : 4);
  }
}

std::vector<uint32_t> counting(int64_t n, uint32_t scale) {
  std::vector<uint32_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(static_cast<uint32_t>(i) * scale);
  return ids;
}

std::string refusal(const std::string& spec) {
  try {
    read_token_ids(inspect_token_file(spec));
  } catch (const Error& e) {
    return e.what();
  }
  return "accepted";
}

TEST(TokenFile, LlmcIdsBecomeTheDatasetsTokensInOrder) {
  TempDir dir;
  for (const int32_t version : {1, 2}) {
    SCOPED_TRACE(version);
    // uint32 ids above 65535 (a 151,936 vocabulary) and uint16 ids above 255.
    const uint32_t scale = version == 1 ? 300 : 70001;
    const auto ids = counting(200, scale);
    write_llmc(dir.file("t.bin"), version, ids, 0);
    const TokenFileInfo info = inspect_token_file(dir.file("t.bin"));
    EXPECT_EQ(info.tokens, 200);
    EXPECT_EQ(info.width, version == 1 ? 2 : 4);
    const TokenIds read = read_token_ids(info);
    EXPECT_EQ(read.max_id, 199 * int64_t{scale});
    EXPECT_EQ(read.max_at, 199);
    const TextDataset d(read.raw, info.width, info.path, 0.1, 8);
    EXPECT_EQ(d.train_tokens(), 180);
    EXPECT_EQ(d.eval_tokens(), 20);
    // The held-out tail's first window: ids 180..188, the targets one along.
    const Batch eval = d.eval_batches(1, 1).at(0);
    for (int64_t i = 0; i < 8; ++i) {
      EXPECT_EQ(eval.inputs[0][i].item<int64_t>(), (180 + i) * int64_t{scale});
      EXPECT_EQ(eval.targets[0][i].item<int64_t>(), (181 + i) * int64_t{scale});
    }
    // A training window is 9 consecutive ids.
    const Batch b = d.train_batch(3, 0, 0, 4);
    for (int64_t r = 0; r < 4; ++r) {
      const int64_t first = b.inputs[r][0].item<int64_t>() / scale;
      EXPECT_LE(first, 180 - 9);
      for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(b.targets[r][i].item<int64_t>(), (first + 1 + i) * int64_t{scale});
    }
  }
}

TEST(TokenFile, AHeaderlessFileNeedsItsWidthNamed) {
  TempDir dir;
  {
    std::ofstream out(dir.file("nano.bin"), std::ios::binary);
    for (uint16_t id : {7, 65535, 3}) out.write(reinterpret_cast<const char*>(&id), 2);
  }
  const TokenFileInfo info = inspect_token_file("uint16:" + dir.file("nano.bin"));
  EXPECT_EQ(info.tokens, 3);
  EXPECT_EQ(info.format(), "headerless uint16");
  EXPECT_EQ(read_token_ids(info).max_id, 65535);
  EXPECT_THAT(refusal(dir.file("nano.bin")), HasSubstr("shorter than llm.c's 1024-byte header"));
  EXPECT_THAT(refusal("uint32:" + dir.file("nano.bin")), HasSubstr("6 bytes is not a whole number of uint32 ids"));
}

TEST(TokenFile, EveryLieIsRefusedNamingIt) {
  TempDir dir;
  write_llmc(dir.file("truncated.bin"), 1, counting(10, 1), 0, 12);
  EXPECT_THAT(refusal(dir.file("truncated.bin")), HasSubstr("the header says 12 uint16 ids (1048 bytes with the "
                                                              "header), the file has 1044 bytes (truncated?)"));
  write_llmc(dir.file("trailing.bin"), 2, counting(10, 1), 0, 8);
  EXPECT_THAT(refusal(dir.file("trailing.bin")), HasSubstr("trailing data"));
  write_llmc(dir.file("version.bin"), 3, counting(10, 1), 0);
  EXPECT_THAT(refusal(dir.file("version.bin")), HasSubstr("llm.c header version 3; accepted: 1 (uint16 ids) or 2"));
  write_llmc(dir.file("vocab.bin"), 1, {1, 2, 50257, 4}, 50257);
  EXPECT_THAT(refusal(dir.file("vocab.bin")), HasSubstr("id 50257 at position 2 is outside the header's vocabulary "
                                                          "of 50257"));
  std::ofstream(dir.file("text.bin")) << std::string(2000, 'x');
  EXPECT_THAT(refusal(dir.file("text.bin")), HasSubstr("no llm.c header (its first int32 is 2021161080, not 20240520)"));
  EXPECT_THAT(refusal(dir.file("absent.bin")), HasSubstr("no such file"));
}

}  // namespace
}  // namespace headroom
