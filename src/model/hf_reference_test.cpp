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

// A forward without dropout on `path`.
ForwardOptions inference(AttentionPath path) {
  ForwardOptions o;
  o.attention = path;
  o.training = false;
  return o;
}

class MatchesHuggingFace : public ::testing::TestWithParam<std::string> {
 protected:
  // The family's fixture: its directory, its config, the input ids and transformers' logits.
  void SetUp() override {
    dir_ = std::string(HEADROOM_SOURCE_DIR) + "/src/model/testdata/hf/" + GetParam();
    std::ifstream in(dir_ + "/reference.json");
    ASSERT_TRUE(in) << dir_;
    const auto ref = nlohmann::json::parse(in);
    config_ = load_model_config(ref["preset"], ref["overrides"].get<std::vector<std::string>>());
    const auto ids = ref["input_ids"].get<std::vector<std::vector<int64_t>>>();
    ids_ = at::empty({static_cast<int64_t>(ids.size()), static_cast<int64_t>(ids[0].size())}, at::kLong);
    for (size_t b = 0; b < ids.size(); ++b) {
      for (size_t t = 0; t < ids[b].size(); ++t) ids_[b][t] = ids[b][t];
    }
    expected_ = at::tensor(ref["logits"].get<std::vector<float>>()).reshape(ref["shape"].get<std::vector<int64_t>>());
  }

  // The model's logits against transformers', on `path`.
  void expect_logits(const CausalLM& model, AttentionPath path) const {
    c10::NoGradGuard no_grad;
    const auto logits = model.forward(ids_, inference(path));
    ASSERT_EQ(logits.sizes(), expected_.sizes());
    const double diff = (logits - expected_).abs().max().item<double>();
    const double scale = expected_.abs().max().item<double>();
    EXPECT_LT(diff, 1e-4 * std::max(1.0, scale)) << GetParam() << " " << attention_path_name(path)
                                                 << ": max |difference| " << diff << " (logits up to " << scale << ")";
  }

  std::string dir_;
  ModelConfig config_;
  at::Tensor ids_, expected_;
};

TEST_P(MatchesHuggingFace, SameWeightsSameLogits) {
  CausalLM model(config_, at::TensorOptions().dtype(at::kFloat), 0);
  load_checkpoint(dir_, model.parameters(), {});
  for (auto path : {AttentionPath::flash, AttentionPath::math}) expect_logits(model, path);
}

// The same weights read from transformers' own save_pretrained output (model.safetensors, its names
// and layouts) by the Hugging Face loader give the same logits.
TEST_P(MatchesHuggingFace, SameLogitsFromTransformersOwnSafetensors) {
  CausalLM model(config_, at::TensorOptions().dtype(at::kFloat), 0);
  load_hf_weights(dir_ + "/hf", model);
  expect_logits(model, AttentionPath::flash);
}

INSTANTIATE_TEST_SUITE_P(Families, MatchesHuggingFace,
                         ::testing::Values("gpt2", "llama", "mistral", "qwen2", "gpt_neox", "qwen3", "qwen3_moe",
                                           "mixtral", "gemma3", "phi3", "olmo2", "smollm3"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace headroom
