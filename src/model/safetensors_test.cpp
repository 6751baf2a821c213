// The safetensors reader against the safetensors library's own output, its writer against its
// reader, and every kind of broken file refused with the first thing wrong, nothing read.
#include "model/safetensors.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "testing/temp_dir.h"
#include "util/error.h"

namespace headroom {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

const std::string kReference = std::string(HEADROOM_SOURCE_DIR) + "/src/train/testdata/reference.safetensors";

TEST(Safetensors, ReadsWhatTheSafetensorsLibraryWrote) {
  // scripts/make-safetensors-fixture wrote these with safetensors.torch.save_file.
  const SafetensorsFile f = SafetensorsFile::open(kReference);
  EXPECT_EQ(f.entries().size(), 5u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const at::Tensor w = f.load("weight");
  EXPECT_EQ(w.scalar_type(), at::kFloat);
  EXPECT_EQ(w.sizes().vec(), (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(at::equal(w, at::arange(6, at::kFloat).reshape({2, 3}) / 4));
  const at::Tensor h = f.load("half");
  EXPECT_EQ(h.scalar_type(), at::kBFloat16);
  EXPECT_EQ(h[0].item<float>(), 1.5f);
  EXPECT_EQ(h[1].item<float>(), -2.25f);
  EXPECT_TRUE(at::equal(f.load("ids"), at::arange(4, at::kLong) * 1000));
  const at::Tensor flag = f.load("flag");
  EXPECT_EQ(flag.dim(), 0);
  EXPECT_TRUE(flag.item<bool>());
  EXPECT_EQ(f.load("empty").sizes().vec(), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(f.load("empty").scalar_type(), at::kHalf);
}

TEST(Safetensors, WritesWhatItReadsBack) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  const at::Tensor a = at::randn({3, 5});
  const at::Tensor b = at::randn({4, 2}).t();  // not contiguous
  write_safetensors(path, {{"a", a}, {"b", b}, {"c", at::ones({2}, at::kBFloat16)}}, {{"format", "pt"}});
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_TRUE(at::equal(f.load("a"), a));
  EXPECT_TRUE(at::equal(f.load("b"), b));
  EXPECT_TRUE(at::equal(f.load("c"), at::ones({2}, at::kBFloat16)));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  // The data starts 8-byte aligned.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
}

// A file of `header` (its JSON) and `data` bytes.
std::string make_file(const TempDir& dir, const std::string& header, size_t data, const std::string& name = "f") {
  const std::string path = dir.file(name + ".safetensors");
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(data, '\0');
  return path;
}

std::string refusal(const std::string& path) {
  try {
    SafetensorsFile::open(path);
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();  // one line
    return e.what();
  }
  return "accepted";
}

TEST(Safetensors, RefusesEveryBrokenFileNamingWhatIsWrong) {
  TempDir dir;
  const std::string ok = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_EQ(refusal(make_file(dir, ok, 8, "ok")), "accepted");
  EXPECT_THAT(refusal(make_file(dir, ok, 4, "truncated")), HasSubstr("lie outside the 4 bytes of data"));
  EXPECT_THAT(refusal(make_file(dir, ok, 12, "trailing")), HasSubstr("cover 8 bytes of data, the file holds 12"));
  EXPECT_THAT(refusal(make_file(dir, R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "shape")),
              HasSubstr("needs 12 bytes, its offsets hold 8"));
  EXPECT_THAT(refusal(make_file(dir,
                                R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                12, "overlap")),
              HasSubstr("overlap or leave a hole"));
  EXPECT_THAT(refusal(make_file(dir, R"({"x":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8, "dtype")),
              HasSubstr("dtype 'Q4' is not supported"));
  EXPECT_THAT(refusal(make_file(dir, R"({"x":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})",
                                8, "huge")),
              HasSubstr("its offsets hold 8"));
  EXPECT_THAT(refusal(make_file(dir, "not json", 8, "json")), HasSubstr("not a JSON object"));
  {
    const std::string path = dir.file("lying-length.safetensors");
    std::ofstream out(path, std::ios::binary);
    const uint64_t n = uint64_t{1} << 40;
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << "{}";
    out.close();
    EXPECT_THAT(refusal(path), HasSubstr("the header claims 1099511627776 bytes"));
  }
  {
    const std::string path = dir.file("short.safetensors");
    std::ofstream(path, std::ios::binary) << "abc";
    EXPECT_THAT(refusal(path), HasSubstr("truncated: 3 bytes"));
  }
  EXPECT_THAT(refusal(dir.file("missing.safetensors")), HasSubstr("not a readable file"));
}

TEST(Safetensors, AFailedWriteLeavesTheOldFile) {
  TempDir dir;
  const std::string path = dir.file("keep.safetensors");
  write_safetensors(path, {{"a", at::ones({2})}});
  EXPECT_THROW(write_safetensors(path, {{"a", at::zeros({2})}, {"a", at::zeros({2})}}), Error);
  EXPECT_TRUE(at::equal(SafetensorsFile::open(path).load("a"), at::ones({2})));
}

}  // namespace
}  // namespace headroom
