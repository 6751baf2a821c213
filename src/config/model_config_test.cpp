#include "config/model_config.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/causal_lm.h"
#include "util/error.h"

namespace headroom {
namespace {

int64_t built_parameters(const ModelConfig& c) {
  // The meta device allocates nothing: the trainer's own model, counted for free.
  return CausalLM(c, at::TensorOptions().device(at::kMeta).dtype(at::kFloat), 0).num_parameters();
}

struct Published {
  const char* preset;
  int64_t params;  // from the models' Hugging Face cards / model.num_parameters()
};

class PublishedCounts : public ::testing::TestWithParam<Published> {};

TEST_P(PublishedCounts, EqualHuggingFace) {
  const auto& [preset, expected] = GetParam();
  const ModelConfig c = load_model_config(preset);
  EXPECT_EQ(count_parameters(c), expected);
  EXPECT_EQ(built_parameters(c), expected);
}

INSTANTIATE_TEST_SUITE_P(Presets, PublishedCounts,
                         ::testing::Values(Published{"gpt2", 124'439'808}, Published{"llama-3.2-1b", 1'235'814'400},
                                           Published{"qwen2.5-0.5b", 494'032'768},
                                           Published{"pythia-160m", 162'322'944},
                                           Published{"mistral-7b", 7'241'732'096},
                                           Published{"llama-3.1-70b", 70'553'706'496},
                                           // transformers 5.24's models on the meta device (Qwen3-8B's
                                           // and Mixtral-8x7B's also as published)
                                           Published{"qwen3-0.6b", 596'049'920},
                                           Published{"qwen3-8b", 8'190'735'360},
                                           Published{"qwen3-30b-a3b", 30'532'122'624},
                                           Published{"mixtral-8x7b", 46'702'792'704},
                                           Published{"gemma-3-1b", 999'885'952},
                                           Published{"phi-3-mini", 3'821'079'552},
                                           Published{"olmo-2-7b", 7'298'617'344},
                                           Published{"smollm3-3b", 3'075'098'624}),
                         [](const auto& info) {
                           std::string n = info.param.preset;
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

TEST(ModelConfig, FamiliesReadTheirOwnFields) {
  const auto gpt2 = load_model_config("gpt2");
  EXPECT_EQ(gpt2.family, Family::gpt2);
  EXPECT_TRUE(gpt2.learned_positions);
  EXPECT_TRUE(gpt2.tie_word_embeddings);
  EXPECT_EQ(gpt2.intermediate_size, 3072);  // n_inner null: 4 * n_embd
  const auto neox = load_model_config("pythia-160m");
  EXPECT_TRUE(neox.parallel_residual);
  EXPECT_EQ(neox.rotary_dim, 16);  // 64 * 0.25
  const auto qwen = load_model_config("qwen2.5-0.5b");
  EXPECT_TRUE(qwen.qkv_bias);
  EXPECT_FALSE(qwen.out_bias);
  EXPECT_EQ(qwen.num_kv_heads, 2);
  EXPECT_FALSE(qwen.sliding_window.has_value());  // use_sliding_window: false
  const auto llama = load_model_config("llama-3.2-1b");
  ASSERT_TRUE(llama.rope_scaling.has_value());
  EXPECT_EQ(llama.rope_scaling->type, "llama3");
  EXPECT_EQ(load_model_config("mistral-7b").sliding_window, 4096);
  // Hugging Face's defaults: mistral without the key has a 4096 window, with null none; qwen2's
  // window starts at max_window_layers.
  auto no_key = nlohmann::json::parse(R"({"model_type": "mistral", "vocab_size": 256, "hidden_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 64})");
  EXPECT_EQ(model_config_from_json(no_key, "m").sliding_window, 4096);
  no_key["sliding_window"] = nullptr;
  EXPECT_FALSE(model_config_from_json(no_key, "m").sliding_window.has_value());
  const auto windowed = load_model_config("qwen2.5-0.5b", {"use_sliding_window=true", "max_window_layers=21"});
  EXPECT_EQ(windowed.sliding_window, 32768);
  EXPECT_EQ(windowed.window_from_layer, 21);
  // SmolLM3: every 4th layer without rotary, from no_rope_layers or, without it, its interval; a
  // window, when set, on those layers.
  const auto smol = load_model_config("smollm3-3b");
  EXPECT_EQ(smol.family, Family::smollm3);
  for (int64_t i = 0; i < smol.num_layers; ++i) EXPECT_EQ(smol.rotated(i), (i + 1) % 4 != 0) << i;
  EXPECT_DOUBLE_EQ(smol.rope_theta, 5e6);
  const auto every_third = load_model_config("smollm3-3b", {"no_rope_layers=null", "no_rope_layer_interval=3",
                                                            "num_hidden_layers=6"});
  EXPECT_EQ(std::vector<bool>(every_third.rope_layers), (std::vector<bool>{true, true, false, true, true, false}));
  const auto sliding = load_model_config("smollm3-3b", {"num_hidden_layers=4", "use_sliding_window=true",
                                                        "sliding_window=512"});
  EXPECT_EQ(sliding.sliding_layers, (std::vector<bool>{false, false, false, true}));
  EXPECT_TRUE(load_model_config("llama-3.2-1b").rotated(3));
  EXPECT_FALSE(load_model_config("gpt2").rotated(0));  // learned positions
}

// transformers 5 saves the rotary settings as rope_parameters; the same model reads the same.
TEST(ModelConfig, ReadsTransformers5RopeParameters) {
  nlohmann::json llama = load_model_config("llama-3.2-1b").source;
  llama.erase("rope_theta");
  llama.erase("rope_scaling");
  llama["rope_parameters"] = nlohmann::json::parse(R"({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})");
  const ModelConfig v5 = model_config_from_json(llama, "v5");
  EXPECT_EQ(v5.rope_theta, 500000.0);
  ASSERT_TRUE(v5.rope_scaling.has_value());
  EXPECT_EQ(v5.rope_scaling->type, "llama3");
  EXPECT_EQ(v5.rope_scaling->factor, 32.0);
  EXPECT_EQ(v5.rope_scaling->original_max_positions, 8192);

  nlohmann::json neox = load_model_config("pythia-160m").source;
  neox.erase("rotary_pct");
  neox.erase("rotary_emb_base");
  neox["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 20000.0}, {"partial_rotary_factor", 0.5}};
  const ModelConfig n5 = model_config_from_json(neox, "v5");
  EXPECT_EQ(n5.rotary_dim, 32);  // 64 * 0.5
  EXPECT_EQ(n5.rope_theta, 20000.0);
  EXPECT_FALSE(n5.rope_scaling.has_value());

  llama["rope_parameters"]["rope_type"] = "yarn";
  EXPECT_THAT([&] { model_config_from_json(llama, "v5"); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("rope_parameters type 'yarn' is not supported")));
}

TEST(ModelConfig, OverridesApplyAndTyposAreRefused) {
  const auto c = load_model_config("gpt2", {"n_layer=2", "n_embd=64", "n_head=4"});
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_THAT([] { load_model_config("gpt2", {"num_hidden_layers=2"}); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("has no field 'num_hidden_layers'")));
  EXPECT_THAT([] { load_model_config("gpt2", {"n_layer"}); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("expected key=value")));
}

TEST(ModelConfig, BadInputGetsOneLineErrors) {
  using ::testing::HasSubstr;
  using ::testing::ThrowsMessage;
  EXPECT_THAT(
      [] {
        model_config_from_json({{"model_type", "bert"}}, "x.json");
      },
      ThrowsMessage<Error>(HasSubstr("model_type 'bert' is not native to headroom (native: gpt2, llama")));
  EXPECT_THAT(
      [] {
        model_config_from_json({{"model_type", "llama"}, {"vocab_size", 10}}, "x.json");
      },
      ThrowsMessage<Error>(HasSubstr("missing field 'hidden_size'")));
  EXPECT_THAT([] { load_model_config("tiny", {"hidden_size=-8"}); },
              ThrowsMessage<Error>(HasSubstr("hidden size must be positive")));
  EXPECT_THAT([] { load_model_config("tiny", {"num_key_value_heads=3"}); },
              ThrowsMessage<Error>(HasSubstr("not a multiple of 3 key/value heads")));
  EXPECT_THAT([] { load_model_config("/nonexistent/config.json"); },
              ThrowsMessage<Error>(HasSubstr("cannot read '/nonexistent/config.json'")));
  EXPECT_THAT([] { load_model_config("tiny", {"vocab_size=\"many\""}); },
              ThrowsMessage<Error>(HasSubstr("'vocab_size' must be an integer")));
  EXPECT_THAT([] { load_model_config("tiny", {"head_dim=4611686018427387904"}); },
              ThrowsMessage<Error>(HasSubstr("field 'head_dim' is out of range: 4611686018427387904")));
  EXPECT_THAT([] { load_model_config("tiny", {"head_dim=100000"}); }, ThrowsMessage<Error>(HasSubstr("sizes out of range")));
  // Each size within its range, together absurd: refused before the parameter count could overflow.
  EXPECT_THAT([] { load_model_config("tiny", {"hidden_size=1048576", "intermediate_size=4194304",
                                              "num_hidden_layers=10000", "num_attention_heads=16384",
                                              "num_key_value_heads=16384", "head_dim=64"}); },
              ThrowsMessage<Error>(HasSubstr("parameters; accepted: at most 10^15")));
  EXPECT_THAT([] { load_model_config("llama-3.2-1b", {R"(rope_scaling={"rope_type":"llama3","factor":"big"})"}); },
              ThrowsMessage<Error>(HasSubstr("rope_scaling.factor must be a number")));
  EXPECT_THAT([] { load_model_config("gpt2", {"scale_attn_by_inverse_layer_idx=true"}); },
              ThrowsMessage<Error>(HasSubstr("scale_attn_by_inverse_layer_idx = true is not supported")));
  EXPECT_THAT([] { load_model_config("smollm3-3b", {"no_rope_layers=[1,1,2]", "num_hidden_layers=3"}); },
              ThrowsMessage<Error>(HasSubstr("no_rope_layers[2] is 2; accepted: 1 (rotary) or 0 (none)")));
  EXPECT_THAT([] { load_model_config("smollm3-3b", {"no_rope_layers=[1,0]"}); },
              ThrowsMessage<Error>(HasSubstr("no_rope_layers must be a list of at least num_hidden_layers (36)")));
  // A directory is read as a checkpoint's: its config.json, or an error saying there is none.
  EXPECT_THAT([] { load_model_config("/proc"); },
              ThrowsMessage<Error>(HasSubstr("--model '/proc': a directory without a config.json")));
}

TEST(ModelConfig, PresetsIncludeTheBundledOnes) {
  EXPECT_THAT(preset_names(), ::testing::IsSupersetOf({"tiny", "small", "gpt2", "llama-3.2-1b", "qwen2.5-0.5b",
                                                       "pythia-160m", "mistral-7b", "llama-3.1-70b"}));
}

}  // namespace
}  // namespace headroom
