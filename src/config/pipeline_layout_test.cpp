// --pipeline-split's parsing and the stage cut: contiguous ranges, and the balanced cut against
// hand-computed optima.
#include "config/pipeline_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "util/error.h"

namespace headroom {
namespace {

using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(PipelineLayout, ASplitReadsBackAsWritten) {
  const std::vector<LayerRange> split = parse_pipeline_split("0:12,12:20,20:24");
  EXPECT_EQ(split, (std::vector<LayerRange>{{0, 12}, {12, 20}, {20, 24}}));
  EXPECT_EQ(pipeline_split_text(split), "0:12,12:20,20:24");
}

TEST(PipelineLayout, ABadSplitSaysWhatIsAccepted) {
  EXPECT_THAT(error_of([] { parse_pipeline_split("0:12,13:24"); }), HasSubstr("should start at layer 12"));
  EXPECT_THAT(error_of([] { parse_pipeline_split("1:12"); }), HasSubstr("should start at layer 0"));
  EXPECT_THAT(error_of([] { parse_pipeline_split("0:0"); }), HasSubstr("holds no layer"));
  EXPECT_THAT(error_of([] { parse_pipeline_split("0-12"); }), HasSubstr("is not FIRST:END"));
  EXPECT_THAT(error_of([] { parse_pipeline_split("0:x"); }), HasSubstr("not a layer number"));
  EXPECT_THAT(error_of([] { parse_pipeline_split(""); }), HasSubstr("accepted: contiguous ranges"));
}

// Six layers of 10 parameters, embeddings of 25 and a head of 5, three stages. Each stage needs a
// layer, so stage 0 holds at least 35; that is the optimum. Within it the middle and last stages
// share 5 layers as 2 + 3 (35, 20, 35: squares 2850) or 3 + 2 (35, 30, 25: 2750, the more even).
TEST(PipelineLayout, TheBalancedCutHasTheSmallestLargestStage) {
  const std::vector<int64_t> layers(6, 10);
  EXPECT_EQ(stage_ranges({3, {}}, layers, 25, 5), (std::vector<LayerRange>{{0, 1}, {1, 4}, {4, 6}}));
  // 80 layers of 10 with embeddings and head of 12 in 16 stages: the optimum is 6 layers (5 cannot
  // hold 80 once the ends carry 12 more), and the even cut gives the ends 4 and the middle 5 or 6
  // (4 + 4 + 14 stages of 72 layers): no stage of one layer beside stages of six.
  const std::vector<LayerRange> cut = stage_ranges({16, {}}, std::vector<int64_t>(80, 10), 12, 12);
  ASSERT_EQ(cut.size(), 16u);
  for (size_t k = 0; k < cut.size(); ++k) {
    const int64_t n = cut[k].end - cut[k].first;
    EXPECT_GE(n, 4) << "stage " << k;
    EXPECT_LE(n, 6) << "stage " << k;
  }
  // Without embeddings or head to weigh, 6 equal layers in 2 stages: 3 each.
  EXPECT_EQ(stage_ranges({2, {}}, layers, 0, 0), (std::vector<LayerRange>{{0, 3}, {3, 6}}));
  // 7 layers in 2: the optimum 40 lets the last stage take 4.
  EXPECT_EQ(stage_ranges({2, {}}, std::vector<int64_t>(7, 10), 0, 0), (std::vector<LayerRange>{{0, 3}, {3, 7}}));
  // A large head (an untied vocabulary) pulls layers to the first stage: 10+10 | 10 + 25.
  EXPECT_EQ(stage_ranges({2, {}}, std::vector<int64_t>(3, 10), 0, 25), (std::vector<LayerRange>{{0, 2}, {2, 3}}));
  // One stage: everything.
  EXPECT_EQ(stage_ranges({1, {}}, layers, 25, 5), (std::vector<LayerRange>{{0, 6}}));
}

TEST(PipelineLayout, AGivenSplitMustFitTheModel) {
  const std::vector<int64_t> layers(4, 10);
  EXPECT_EQ(stage_ranges({2, {{0, 1}, {1, 4}}}, layers, 0, 0), (std::vector<LayerRange>{{0, 1}, {1, 4}}));
  EXPECT_THAT(error_of([&] { stage_ranges({2, {{0, 1}, {1, 3}}}, layers, 0, 0); }),
              HasSubstr("ends at layer 3, and the model has 4 layers"));
  EXPECT_THAT(error_of([&] { stage_ranges({3, {{0, 1}, {1, 4}}}, layers, 0, 0); }), HasSubstr("one range per stage"));
  EXPECT_THAT(error_of([&] { stage_ranges({5, {}}, layers, 0, 0); }),
              HasSubstr("--pipeline 5: the model has 4 layers"));
}

}  // namespace
}  // namespace headroom

namespace headroom {
namespace {

// The even cut: every stage within one layer of the others, so its largest holds ceil(layers / P);
// the stages holding one more are the middle ones from the last but one down, then the last, then
// the first. Hand-written cuts.
TEST(PipelineLayout, TheEvenCutsLargestStageIsAsSmallAsAnyCutsCanBe) {
  EXPECT_EQ(pipeline_split_text(even_cut(80, 8)), "0:10,10:20,20:30,30:40,40:50,50:60,60:70,70:80");
  EXPECT_EQ(pipeline_split_text(even_cut(6, 4)), "0:1,1:3,3:5,5:6");
  EXPECT_EQ(pipeline_split_text(even_cut(7, 4)), "0:1,1:3,3:5,5:7");
  EXPECT_EQ(pipeline_split_text(even_cut(7, 2)), "0:3,3:7");
  EXPECT_EQ(pipeline_split_text(even_cut(126, 8)), "0:15,15:31,31:47,47:63,63:79,79:95,95:111,111:126");
  EXPECT_EQ(pipeline_split_text(even_cut(5, 5)), "0:1,1:2,2:3,3:4,4:5");
  EXPECT_EQ(pipeline_split_text(even_cut(4, 1)), "0:4");
  for (int64_t layers = 1; layers <= 40; ++layers) {
    for (int64_t p = 1; p <= layers; ++p) {
      const std::vector<LayerRange> cut = even_cut(layers, p);
      ASSERT_EQ(static_cast<int64_t>(cut.size()), p);
      EXPECT_EQ(cut.front().first, 0);
      EXPECT_EQ(cut.back().end, layers);
      for (size_t s = 0; s < cut.size(); ++s) {
        if (s > 0) {
          EXPECT_EQ(cut[s].first, cut[s - 1].end);
        }
        const int64_t n = cut[s].end - cut[s].first;
        EXPECT_TRUE(n == layers / p || n == (layers + p - 1) / p) << layers << " layers, " << p << " stages";
      }
    }
  }
  EXPECT_THROW(even_cut(3, 4), Error);
}

}  // namespace
}  // namespace headroom
