// The model against Hugging Face's own implementation: for a shrunk model of each family, with the
// same random weights (biases and norm weights included), the logits must equal the ones that
// transformers computed (scripts/make-hf-fixtures wrote them into testdata/hf). This checks the
// architecture itself — qkv layouts, rotary pairing and scaling, residual order, norms,
// activations, sliding windows, tied heads — not only the parameter count.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include <fstream>

#include "config/model_config.h"
#include "model/causal_lm.h"
#include "model/hf_weights.h"
#include "train/checkpoint.h"

namespace headroom {
namespace {

class MatchesHuggingFace : public ::testing::TestWithParam<std::string> {};

TEST_P(MatchesHuggingFace, SameWeightsSameLogits) {
  const std::string dir = std::string(HEADROOM_SOURCE_DIR) + "/src/model/testdata/hf/" + GetParam();
  std::ifstream in(dir + "/reference.json");
  ASSERT_TRUE(in) << dir;
  const auto ref = nlohmann::json::parse(in);
  const ModelConfig cfg = load_model_config(ref["preset"], ref["overrides"].get<std::vector<std::string>>());
  CausalLM model(cfg, at::TensorOptions().dtype(at::kFloat), 0);
  load_checkpoint(dir, model.parameters(), {});

  const auto ids_list = ref["input_ids"].get<std::vector<std::vector<int64_t>>>();
  auto ids = at::empty({static_cast<int64_t>(ids_list.size()), static_cast<int64_t>(ids_list[0].size())}, at::kLong);
  for (size_t b = 0; b < ids_list.size(); ++b) {
    for (size_t t = 0; t < ids_list[b].size(); ++t) ids[b][t] = ids_list[b][t];
  }
  const auto values = ref["logits"].get<std::vector<float>>();
  const auto expected = at::tensor(values).reshape(ref["shape"].get<std::vector<int64_t>>());

  c10::NoGradGuard no_grad;
  for (auto path : {AttentionPath::flash, AttentionPath::math}) {
    const auto logits = model.forward(ids, {path, /*training=*/false});
    ASSERT_EQ(logits.sizes(), expected.sizes());
    const double diff = (logits - expected).abs().max().item<double>();
    const double scale = expected.abs().max().item<double>();
    EXPECT_LT(diff, 1e-4 * std::max(1.0, scale)) << GetParam() << " " << attention_path_name(path)
                                                 << ": max |difference| " << diff << " (logits up to " << scale << ")";
  }
}

// The same weights read from transformers' own save_pretrained output (model.safetensors, its names
// and layouts) by the Hugging Face loader give the same logits.
TEST_P(MatchesHuggingFace, SameLogitsFromTransformersOwnSafetensors) {
  const std::string dir = std::string(HEADROOM_SOURCE_DIR) + "/src/model/testdata/hf/" + GetParam();
  std::ifstream in(dir + "/reference.json");
  ASSERT_TRUE(in) << dir;
  const auto ref = nlohmann::json::parse(in);
  const ModelConfig cfg = load_model_config(ref["preset"], ref["overrides"].get<std::vector<std::string>>());
  CausalLM model(cfg, at::TensorOptions().dtype(at::kFloat), 0);
  load_hf_weights(dir + "/hf", model);
  const auto ids_list = ref["input_ids"].get<std::vector<std::vector<int64_t>>>();
  auto ids = at::empty({static_cast<int64_t>(ids_list.size()), static_cast<int64_t>(ids_list[0].size())}, at::kLong);
  for (size_t b = 0; b < ids_list.size(); ++b) {
    for (size_t t = 0; t < ids_list[b].size(); ++t) ids[b][t] = ids_list[b][t];
  }
  const auto expected = at::tensor(ref["logits"].get<std::vector<float>>()).reshape(ref["shape"].get<std::vector<int64_t>>());
  c10::NoGradGuard no_grad;
  const auto logits = model.forward(ids, {AttentionPath::flash, /*training=*/false});
  const double diff = (logits - expected).abs().max().item<double>();
  EXPECT_LT(diff, 1e-4 * std::max(1.0, expected.abs().max().item<double>())) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Families, MatchesHuggingFace,
                         ::testing::Values("gpt2", "llama", "mistral", "qwen2", "gpt_neox", "qwen3", "qwen3_moe",
                                           "mixtral", "gemma3", "phi3", "olmo2"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace headroom
