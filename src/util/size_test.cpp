#include "util/size.h"

#include <gtest/gtest.h>

#include "util/error.h"

namespace headroom {

TEST(ParseSize, AcceptsDecimalAndBinaryUnits) {
  EXPECT_EQ(parse_size("512MiB", "x"), 512LL * 1024 * 1024);
  EXPECT_EQ(parse_size("24GiB", "x"), 24LL * 1024 * 1024 * 1024);
  EXPECT_EQ(parse_size("80GB", "x"), 80'000'000'000LL);
  EXPECT_EQ(parse_size("1000", "x"), 1000);
  EXPECT_EQ(parse_size("1.5 KiB", "x"), 1536);
  EXPECT_EQ(parse_size("2kb", "x"), 2000);
}

TEST(ParseSize, RejectsGarbageWithTheFlagName) {
  for (const char* bad : {"", "abc", "12XB", "-5MiB", "1.2.3GB", "GiB"}) {
    try {
      parse_size(bad, "--memory-budget");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--memory-budget"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("MiB"), std::string::npos) << "should say what is accepted";
    }
  }
  EXPECT_THROW(parse_size("99999999TiB", "x"), Error);
}

TEST(FormatSize, WritesTheUnitAPersonWouldAndReadsBack) {
  EXPECT_EQ(format_size(146800640), "140MiB");
  EXPECT_EQ(format_size(24LL << 30), "24GiB");
  EXPECT_EQ(format_size(1'198'000'000), "1198MB");
  EXPECT_EQ(format_size(80'000'000'000LL), "80GB");
  EXPECT_EQ(format_size(1024000), "1000KiB");
  EXPECT_EQ(format_size(1536), "1536");
  EXPECT_EQ(format_size(0), "0");
  uint64_t x = 88172645463325252ULL;  // xorshift: sizes of every magnitude, from a fixed seed
  for (int i = 0; i < 2000; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const int64_t bytes = static_cast<int64_t>(x >> (2 + i % 60));
    if (bytes > (int64_t{1} << 62)) continue;
    EXPECT_EQ(parse_size(format_size(bytes), "x"), bytes) << format_size(bytes);
  }
}

TEST(FormatBytes, UsesBinaryUnits) {
  EXPECT_EQ(format_bytes(17), "17 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(512LL * 1024 * 1024), "512 MiB");
  EXPECT_EQ(format_bytes(-2048), "-2.00 KiB");
}

TEST(Size, DurationsPrintAsClockTime) {
  EXPECT_EQ(format_duration(42), "0:42");
  EXPECT_EQ(format_duration(725.4), "12:05");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_EQ(format_duration(-3), "0:00");
}

}  // namespace headroom
