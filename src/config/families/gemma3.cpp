// Gemma 3 (Gemma3ForCausalLM; a multimodal gemma3 config's text_config): sliding-window and global
// layers in a 5:1 pattern (layer_types, or sliding_window_pattern), each kind with its own rotary
// base; RMS norms that scale by (1 + weight), four per layer around attention and the MLP; q and k
// normed per head; embeddings scaled by sqrt(hidden_size); the softmax scaled by
// query_pre_attn_scalar^-1/2; gelu-tanh; a tied head. Soft-capping (Gemma 2's) is refused.
#include <cmath>

#include "config/family_readers.h"

namespace headroom::config_reading {

void read_gemma3(FieldReader& r, ModelConfig& c, const std::string& origin) {
  // Gemma3TextConfig's defaults: a multimodal config's text_config often names only a few fields.
  c.vocab_size = r.integer_or("vocab_size", 262208);
  c.hidden_size = r.integer_or("hidden_size", 2304);
  c.num_layers = r.integer_or("num_hidden_layers", 26);
  c.num_heads = r.integer_or("num_attention_heads", 8);
  c.num_kv_heads = r.integer_or("num_key_value_heads", 4);
  c.head_dim = r.integer_or("head_dim", 256);
  c.intermediate_size = r.integer_or("intermediate_size", 9216);
  c.max_positions = r.integer_or("max_position_embeddings", 131072);
  c.norm = NormKind::rms_norm;
  c.norm_eps = r.number_or("rms_norm_eps", 1e-6);
  c.norm_plus_one = true;
  c.norm_placement = NormPlacement::sandwich;
  c.qk_norm = QkNorm::per_head;
  c.activation = parse_activation(r.string_or("hidden_activation", "gelu_pytorch_tanh"), origin);
  c.gated_mlp = true;
  c.rotary_dim = c.head_dim;
  c.qkv_bias = c.out_bias = r.boolean_or("attention_bias", false);
  c.attn_dropout = r.number_or("attention_dropout", 0.0);
  c.initializer_range = r.number_or("initializer_range", 0.02);
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", true);
  c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
  const double scalar = r.number_or("query_pre_attn_scalar", 256);
  if (!(scalar > 0)) fail("{}: query_pre_attn_scalar must be positive, got {}", origin, scalar);
  c.attn_scale = 1.0 / std::sqrt(scalar);
  for (const char* cap : {"final_logit_softcapping", "attn_logit_softcapping"}) {
    if (r.has(cap)) fail("{}: {} is not supported (Gemma 3 has none); accepted: null", origin, cap);
  }
  if (r.boolean_or("use_bidirectional_attention", false)) {
    fail("{}: use_bidirectional_attention = true is not supported (a causal language model only)", origin);
  }

  // Rotary: transformers 5 writes one object per layer kind; earlier configs rope_theta (global),
  // rope_local_base_freq (sliding) and rope_scaling (global layers only).
  double global = 1e6, local = 10000.0;
  const json* nested = nullptr;
  if (r.has("rope_parameters")) {
    const json& p = r.raw("rope_parameters");
    if (!p.is_object()) fail("{}: field 'rope_parameters' must be an object or null", origin);
    if (p.contains("full_attention") || p.contains("sliding_attention")) nested = &p;
  }
  if (nested) {
    auto kind = [&](const char* key) -> const json* {
      if (!nested->contains(key) || nested->at(key).is_null()) return nullptr;
      if (!nested->at(key).is_object()) fail("{}: rope_parameters.{} must be an object", origin, key);
      return &nested->at(key);
    };
    if (const json* full = kind("full_attention")) {
      global = rope_number(*full, "rope_parameters.full_attention", "rope_theta", global, origin);
      c.rope_scaling = rope_scaling_from(*full, "rope_parameters.full_attention", origin);
    }
    if (const json* sliding = kind("sliding_attention")) {
      local = rope_number(*sliding, "rope_parameters.sliding_attention", "rope_theta", local, origin);
      if (rope_scaling_from(*sliding, "rope_parameters.sliding_attention", origin)) {
        fail("{}: rope_parameters.sliding_attention: frequency scaling of the sliding layers is not supported; "
             "accepted: rope_type default",
             origin);
      }
    }
  } else {
    global = r.number_or("rope_theta", rope_parameter(r, "rope_theta", global, origin));
    local = r.number_or("rope_local_base_freq", local);
    read_rope_scaling(r, c, origin);
  }
  c.rope_theta = global;
  c.local_rope_theta = local;

  c.sliding_window = r.integer_or("sliding_window", 4096);
  if (!read_layer_types(r, c, origin)) {
    const int64_t pattern = r.integer_or("sliding_window_pattern", 6);
    if (pattern < 1) fail("{}: sliding_window_pattern must be at least 1, got {}", origin, pattern);
    c.sliding_layers.clear();
    for (int64_t i = 0; i < c.num_layers; ++i) c.sliding_layers.push_back((i + 1) % pattern != 0);
  }
}

}  // namespace headroom::config_reading
