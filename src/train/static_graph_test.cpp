#include "train/static_graph.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "config/model_config.h"
#include "device/cuda_adapter.h"
#include "util/error.h"

namespace headroom {
namespace {

using ::testing::HasSubstr;

RunConfig graph_run(const std::string& device) {
  RunConfig c;
  c.model = "tiny";  // llama family, no dropout: a replay must compute the eager loss
  c.overrides = {"num_hidden_layers=2"};
  c.device = device;
  c.batch = 4;
  c.accum = 2;
  c.seq = 64;
  return c;
}

// The point of the trial is a CUDA measurement; without a GPU what can be checked is that it says so.
TEST(StaticGraph, ReplaysTheEagerStepOnCudaAndSaysItNeedsCudaElsewhere) {
  if (!cuda_available()) {
    try {
      measure_static_graph(graph_run("cpu"), 3);
      FAIL() << "a static-graph trial on cpu must be refused";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("need --device cuda"));
    }
    return;
  }
  const StaticGraphTrial t = measure_static_graph(graph_run("cuda"), 3);
  ASSERT_TRUE(t.captured) << t.failure;
  // Same weights, same tokens, no dropout: the replayed forward is the eager one.
  EXPECT_NEAR(t.graphed_first_loss, t.eager_first_loss, 1e-4 * std::abs(t.eager_first_loss));
  // A byte-level model's loss starts near ln(256) and three steps do not move it far.
  EXPECT_GT(t.eager_first_loss, 2.0);
  EXPECT_LT(t.eager_first_loss, 7.0);
  EXPECT_GT(t.eager_step_seconds, 0);
  EXPECT_GT(t.graphed_step_seconds, 0);
  // fp32 AdamW holds 16 bytes a parameter (weight, gradient, two moments) through both runs; the
  // graph's private pool comes on top.
  const ModelConfig model = load_model_config("tiny", {"num_hidden_layers=2"});
  EXPECT_GT(t.graphed_peak_reserved, 16 * count_parameters(model));
  EXPECT_GT(t.eager_peak_reserved, 16 * count_parameters(model));
}

}  // namespace
}  // namespace headroom
