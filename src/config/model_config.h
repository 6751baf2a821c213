// ModelConfig — one Transformer architecture, read from a Hugging Face config.json.
//
// Families: gpt2, llama, mistral, qwen2, gpt_neox, qwen3, qwen3_moe, mixtral, gemma3, phi3, olmo2,
// smollm3.
// Each family's reader (the older five in model_config.cpp, the rest one file each in
// config/families/) maps its own field names (n_embd, hidden_size, ...) onto this one normalised
// struct of switches, applying Hugging Face's defaults for optional fields; a new family is one
// reader and one row of the table in model_config.cpp. A missing required field, an unknown model_type or an inconsistent size is an
// Error naming it. The trainer (model/), and later the estimator, read only this struct.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace headroom {

enum class Family { gpt2, llama, mistral, qwen2, gpt_neox, qwen3, qwen3_moe, mixtral, gemma3, phi3, olmo2, smollm3 };
enum class NormKind { layer_norm, rms_norm };
enum class Activation { gelu, gelu_tanh, silu, relu };
// RMS norms of the queries and keys before rotary: none, per head over head_dim (qwen3, gemma3),
// or over the whole projection (olmo2).
enum class QkNorm { none, per_head, whole };
// Where a layer's norms sit around attention and the MLP (f): pre, x + f(norm(x)) (Llama); post,
// x + norm(f(x)) (OLMo-2); sandwich, x + norm_out(f(norm_in(x))) (Gemma 2 and 3).
enum class NormPlacement { pre, post, sandwich };

// Mixture of experts in place of the MLP (qwen3_moe, mixtral): a router picks top_k of `experts`
// gated MLPs for each token.
struct MoeConfig {
  int64_t experts = 0;
  int64_t top_k = 0;
  int64_t intermediate_size = 0;  // each expert's
  bool normalise_top_k = true;    // the top-k routing weights rescaled to sum to one
  int64_t sparse_step = 1;        // qwen3_moe: layer i is sparse when (i + 1) % sparse_step == 0 ...
  std::vector<int64_t> dense_layers;  // ... and it is not one of these (mlp_only_layers)
  bool aux_loss = false;              // output_router_logits: the load-balancing loss joins the loss
  double aux_loss_coef = 0.0;         // router_aux_loss_coef
  bool operator==(const MoeConfig&) const = default;
};

// Rotary frequency scaling ("rope_scaling" in config.json).
struct RopeScaling {
  std::string type;  // "llama3" or "linear"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_positions = 8192;
  bool operator==(const RopeScaling&) const = default;
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
  std::vector<bool> rope_layers;  // when not empty, which layers rotate (smollm3: every 4th does not)

  bool qkv_bias = false;
  bool out_bias = false;
  bool mlp_bias = false;
  bool fused_qkv = false;          // one qkv projection (gpt2, gpt_neox) vs three
  bool parallel_residual = false;  // gpt_neox: x + attn(ln1(x)) + mlp(ln2(x))
  bool tie_word_embeddings = false;
  std::optional<int64_t> sliding_window;
  int64_t window_from_layer = 0;  // layers with index >= this use the window (qwen2: max_window_layers)
  std::vector<bool> sliding_layers;  // when not empty, which layers use the window (gemma3's 5:1 pattern)
  std::optional<double> local_rope_theta;  // the rotary base of windowed layers, when theirs (gemma3)

  QkNorm qk_norm = QkNorm::none;
  NormPlacement norm_placement = NormPlacement::pre;
  bool norm_plus_one = false;       // gemma: an RMS norm scales by (1 + weight), its weight stored as zero
  double embed_scale = 1.0;         // gemma: embeddings times sqrt(hidden_size), rounded to the weights' dtype
  std::optional<double> attn_scale;  // the attention's softmax scale; default 1/sqrt(head_dim)
  bool fused_gate_up = false;        // phi3: one gate_up projection, the gate its first half
  std::optional<MoeConfig> moe;

  double embd_dropout = 0.0;
  double attn_dropout = 0.0;
  double resid_dropout = 0.0;
  double initializer_range = 0.02;

  nlohmann::json source;  // the config.json as read, with --set overrides applied

  // Layer i attends through the sliding window.
  bool windowed(int64_t layer) const;
  // Layer i rotates its queries and keys (rotary position embeddings).
  bool rotated(int64_t layer) const;
  // Layer i's MLP is a mixture of experts.
  bool sparse(int64_t layer) const;
  bool operator==(const ModelConfig&) const = default;
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
