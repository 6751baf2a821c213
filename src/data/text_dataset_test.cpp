#include "data/text_dataset.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "data/embedded.h"
#include "util/error.h"

namespace headroom {
namespace {

TEST(TextDataset, BytesAreTokensAndTargetsAreShiftedInputs) {
  TextDataset d("abcdefghijklmnopqrstuvwxyz0123456789", "t", 0.5, 4);
  const Batch b = d.train_batch(1, 0, 0, 3);
  ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{3, 4}));
  EXPECT_TRUE(at::equal(b.inputs.narrow(1, 1, 3), b.targets.narrow(1, 0, 3)));
  for (int64_t r = 0; r < 3; ++r) {
    const int64_t first = b.inputs[r][0].item<int64_t>();
    EXPECT_GE(first, 'a');
    EXPECT_LE(first, 'r');  // train split is the first 18 bytes
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(b.inputs[r][i].item<int64_t>(), first + i);
  }
}

TEST(TextDataset, RowsDoNotDependOnHowTheBatchIsSplit) {
  const TextDataset d = TextDataset::load("", 0.1, 32);
  const Batch whole = d.train_batch(42, 5, 0, 8);
  const Batch first = d.train_batch(42, 5, 0, 4);
  const Batch second = d.train_batch(42, 5, 4, 4);
  EXPECT_TRUE(at::equal(whole.inputs, at::cat({first.inputs, second.inputs})));
  EXPECT_FALSE(at::equal(whole.inputs, d.train_batch(42, 6, 0, 8).inputs));
  EXPECT_FALSE(at::equal(whole.inputs, d.train_batch(43, 5, 0, 8).inputs));
}

TEST(TextDataset, EvalUsesTheHeldOutTail) {
  const TextDataset d = TextDataset::load("", 0.1, 64);
  const auto n = static_cast<int64_t>(embedded_corpus().size());
  EXPECT_EQ(d.eval_tokens(), n / 10);
  EXPECT_EQ(d.train_tokens() + d.eval_tokens(), n);
  const auto batches = d.eval_batches(8, 20);
  ASSERT_EQ(batches.size(), 3u);  // 8 + 8 + 4
  EXPECT_EQ(batches[2].inputs.size(0), 4);
  // The first eval window is the first bytes of the tail.
  const std::string_view tail = embedded_corpus().substr(static_cast<size_t>(n - n / 10));
  EXPECT_EQ(batches[0].inputs[0][0].item<int64_t>(), static_cast<unsigned char>(tail[0]));
}

TEST(TextDataset, TooShortOrMissingIsAnError) {
  EXPECT_THAT([] { TextDataset("short", "tiny.txt", 0.1, 128); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("too short for --seq 128")));
  EXPECT_THAT([] { TextDataset::load("/no/such/file.txt", 0.1, 8); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("--data: cannot read '/no/such/file.txt'")));
}

}  // namespace
}  // namespace headroom
