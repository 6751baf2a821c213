// Shrunk variants of every supported family, for tests: same layout as the published configs
// (biases, GQA, partial rotary, tied head, sliding window, q/k norms, post and sandwich norms, fused
// gate/up, experts with a dense layer among them), a few hundred thousand parameters.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "config/model_config.h"

namespace headroom::testing {

struct ShrunkModel {
  std::string label;
  std::string preset;
  std::vector<std::string> overrides;
  ModelConfig load() const { return load_model_config(preset, overrides); }
};

// gtest prints parameters byte by byte unless told how.
inline void PrintTo(const ShrunkModel& m, std::ostream* os) { *os << m.label; }

inline std::vector<ShrunkModel> shrunk_models() {
  const std::vector<std::string> llama_like = {"hidden_size=64",
                                               "intermediate_size=128",
                                               "num_attention_heads=4",
                                               "num_key_value_heads=2",
                                               "num_hidden_layers=2",
                                               "vocab_size=256",
                                               "head_dim=16"};
  auto with = [](std::vector<std::string> base, std::vector<std::string> extra) {
    base.insert(base.end(), extra.begin(), extra.end());
    return base;
  };
  return {
      {"gpt2", "gpt2", {"n_layer=2", "n_embd=64", "n_head=4", "vocab_size=256", "n_positions=128"}},
      {"llama", "llama-3.2-1b", llama_like},
      {"mistral", "mistral-7b", with(llama_like, {"sliding_window=8"})},
      {"qwen2", "qwen2.5-0.5b", llama_like},
      {"gpt_neox",
       "pythia-160m",
       {"hidden_size=64", "intermediate_size=256", "num_attention_heads=4", "num_hidden_layers=2", "vocab_size=256"}},
      {"qwen3", "qwen3-0.6b", llama_like},
      {"qwen3_moe", "qwen3-30b-a3b",
       with(llama_like, {"num_hidden_layers=3", "moe_intermediate_size=32", "num_experts=4", "num_experts_per_tok=2",
                         "mlp_only_layers=[1]"})},
      {"mixtral", "mixtral-8x7b", with(llama_like, {"num_local_experts=4", "sliding_window=8"})},
      {"gemma3", "gemma-3-1b", with(llama_like, {"sliding_window=8", "sliding_window_pattern=2"})},
      {"phi3", "phi-3-mini", with(llama_like, {"sliding_window=8"})},
      {"olmo2", "olmo-2-7b", llama_like},
      {"smollm3", "smollm3-3b", with(llama_like, {"no_rope_layers=[1,0]"})},
  };
}

}  // namespace headroom::testing
