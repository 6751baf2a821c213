// ModelConfig — one Transformer architecture, read from a Hugging Face config.json.
//
// Families: gpt2, llama, mistral, qwen2, gpt_neox. Each family's reader maps its own field names
// (n_embd, hidden_size, ...) onto this one normalised struct, applying Hugging Face's defaults for
// optional fields. A missing required field, an unknown model_type or an inconsistent size is an
// Error naming it. The trainer (model/), and later the estimator, read only this struct.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace headroom {

enum class Family { gpt2, llama, mistral, qwen2, gpt_neox };
enum class NormKind { layer_norm, rms_norm };
enum class Activation { gelu, gelu_tanh, silu, relu };

// Rotary frequency scaling ("rope_scaling" in config.json).
struct RopeScaling {
  std::string type;  // "llama3" or "linear"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_positions = 8192;
};

struct ModelConfig {
  std::string name;  // preset name or file path it came from
  Family family = Family::llama;

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // < num_heads: grouped-query attention
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t max_positions = 0;

  NormKind norm = NormKind::rms_norm;
  bool norm_bias = false;  // LayerNorm has a bias, RMSNorm does not
  double norm_eps = 1e-5;
  Activation activation = Activation::silu;
  bool gated_mlp = true;  // SwiGLU (gate, up, down) vs plain two-layer MLP

  bool learned_positions = false;  // gpt2: a position embedding table; the others: rotary
  int64_t rotary_dim = 0;          // leading dims of each head that rotate (gpt_neox: a fraction)
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;

  bool qkv_bias = false;
  bool out_bias = false;
  bool mlp_bias = false;
  bool fused_qkv = false;          // one qkv projection (gpt2, gpt_neox) vs three
  bool parallel_residual = false;  // gpt_neox: x + attn(ln1(x)) + mlp(ln2(x))
  bool tie_word_embeddings = false;
  std::optional<int64_t> sliding_window;
  int64_t window_from_layer = 0;  // layers with index >= this use the window (qwen2: max_window_layers)

  double embd_dropout = 0.0;
  double attn_dropout = 0.0;
  double resid_dropout = 0.0;
  double initializer_range = 0.02;

  nlohmann::json source;  // the config.json as read, with --set overrides applied
};

const char* family_name(Family family);
std::vector<std::string> supported_families();
std::vector<std::string> preset_names();

// Resolves `model` — a bundled preset name ("tiny", "gpt2", ...) or a path to a config.json — and
// applies `overrides` ("key=value"; value parsed as JSON when it parses, else taken as a string).
// Throws Error on anything it cannot accept, naming the field or file.
ModelConfig load_model_config(const std::string& model, const std::vector<std::string>& overrides = {});

// Builds a ModelConfig from an already-parsed config.json; `origin` names it in errors.
ModelConfig model_config_from_json(const nlohmann::json& json, const std::string& origin);

// Parameter count implied by the architecture, computed from sizes alone (no tensors).
int64_t count_parameters(const ModelConfig& config);

}  // namespace headroom
