// The readers every family shares (config/field_reader.h): activations, rotary settings and their
// scaling, the fields Llama introduced, transformers 5's layer_types, Qwen's window.
#include "config/field_reader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <optional>
#include <set>

#include "util/error.h"
#include "util/json.h"

namespace headroom {

using nlohmann::json;

namespace config_reading {

Activation parse_activation(const std::string& name, const std::string& origin) {
  if (name == "gelu") return Activation::gelu;
  if (name == "gelu_new" || name == "gelu_pytorch_tanh" || name == "gelu_fast") return Activation::gelu_tanh;
  if (name == "silu" || name == "swish") return Activation::silu;
  if (name == "relu") return Activation::relu;
  fail("{}: activation '{}' is not supported; accepted: gelu, gelu_new, gelu_pytorch_tanh, silu, relu", origin, name);
}

// transformers 5 writes the rotary settings as one object, rope_parameters ({rope_type, rope_theta,
// factor, ..., partial_rotary_factor}); earlier versions wrote rope_theta (gpt_neox: rotary_emb_base,
// rotary_pct) and rope_scaling. Either is read: the older scalar fields over rope_parameters' values
// where both are present, and rope_parameters over rope_scaling for the scaling.
namespace {
const char* rope_object_key(FieldReader& r) { return r.has("rope_parameters") ? "rope_parameters" : "rope_scaling"; }

}  // namespace

double rope_number(const json& s, const std::string& object, const char* key, double fallback,
                   const std::string& origin) {
  if (!s.contains(key) || s.at(key).is_null()) return fallback;
  if (!s.at(key).is_number()) fail("{}: {}.{} must be a number, got {}", origin, object, key, dump_json(s.at(key)));
  return s.at(key).get<double>();
}

// A rotary setting from rope_parameters (transformers 5), else `fallback`.
double rope_parameter(FieldReader& r, const char* key, double fallback, const std::string& origin) {
  if (!r.has("rope_parameters")) return fallback;
  const json& s = r.raw("rope_parameters");
  if (!s.is_object()) fail("{}: field 'rope_parameters' must be an object or null", origin);
  return rope_number(s, "rope_parameters", key, fallback, origin);
}

void read_rope_scaling(FieldReader& r, ModelConfig& c, const std::string& origin) {
  const char* object = rope_object_key(r);
  if (!r.has(object)) return;
  const json& s = r.raw(object);
  if (!s.is_object()) fail("{}: field '{}' must be an object or null", origin, object);
  c.rope_scaling = rope_scaling_from(s, object, origin);
}

std::optional<RopeScaling> rope_scaling_from(const json& s, const std::string& object, const std::string& origin) {
  auto number = [&](const char* key, double fallback) { return rope_number(s, object, key, fallback, origin); };
  const char* type_key = s.contains("rope_type") ? "rope_type" : "type";
  std::string type = "default";
  if (s.contains(type_key)) {
    if (!s.at(type_key).is_string()) fail("{}: {}.{} must be a string", origin, object, type_key);
    type = s.at(type_key).get<std::string>();
  }
  if (type == "default") return std::nullopt;
  if (type != "llama3" && type != "linear") {
    fail("{}: {} type '{}' is not supported; accepted: default, linear, llama3", origin, object, type);
  }
  RopeScaling rs;
  rs.type = type;
  rs.factor = number("factor", 1.0);
  rs.low_freq_factor = number("low_freq_factor", 1.0);
  rs.high_freq_factor = number("high_freq_factor", 4.0);
  const double original = number("original_max_position_embeddings", 8192);
  if (rs.factor <= 0) fail("{}: {}.factor must be positive, got {}", origin, object, rs.factor);
  if (type == "llama3" && (rs.low_freq_factor <= 0 || rs.high_freq_factor <= rs.low_freq_factor || original < 1)) {
    fail(
        "{}: {} (llama3) needs 0 < low_freq_factor < high_freq_factor and "
        "original_max_position_embeddings >= 1",
        origin, object);
  }
  rs.original_max_positions = static_cast<int64_t>(std::min(original, 1e9));
  return rs;
}

void read_sizes(FieldReader& r, ModelConfig& c) {
  c.vocab_size = r.integer("vocab_size");
  c.hidden_size = r.integer("hidden_size");
  c.num_layers = r.integer("num_hidden_layers");
  c.num_heads = r.integer("num_attention_heads");
  c.intermediate_size = r.integer("intermediate_size");
  c.max_positions = r.integer("max_position_embeddings");
}

void read_decoder_core(FieldReader& r, ModelConfig& c, const std::string& origin, double default_theta,
                       const char* activation_key) {
  read_sizes(r, c);
  c.num_kv_heads = r.integer_or("num_key_value_heads", c.num_heads);
  c.head_dim = r.integer_or("head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  c.norm = NormKind::rms_norm;
  c.norm_eps = r.number_or("rms_norm_eps", 1e-6);
  c.activation = parse_activation(r.string_or(activation_key, "silu"), origin);
  c.gated_mlp = true;
  c.rotary_dim = c.head_dim;
  c.rope_theta = r.number_or("rope_theta", rope_parameter(r, "rope_theta", default_theta, origin));
  read_rope_scaling(r, c, origin);
  c.attn_dropout = r.number_or("attention_dropout", 0.0);
  c.initializer_range = r.number_or("initializer_range", 0.02);
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);
}

bool read_layer_types(FieldReader& r, ModelConfig& c, const std::string& origin) {
  if (!r.has("layer_types")) return false;
  const json& types = r.raw("layer_types");
  if (!types.is_array() || static_cast<int64_t>(types.size()) < c.num_layers) {
    fail("{}: layer_types must be a list of at least num_hidden_layers ({}) entries", origin, c.num_layers);
  }
  c.sliding_layers.clear();
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const json& t = types.at(static_cast<size_t>(i));
    if (t != "sliding_attention" && t != "full_attention") {
      fail("{}: layer_types[{}] is {}; accepted: \"sliding_attention\", \"full_attention\"", origin, i, dump_json(t));
    }
    c.sliding_layers.push_back(t == "sliding_attention");
  }
  return true;
}

void read_qwen_window(FieldReader& r, ModelConfig& c) {
  if (r.boolean_or("use_sliding_window", false) && r.has("sliding_window")) {
    c.sliding_window = r.integer("sliding_window");
    c.window_from_layer = r.integer_or("max_window_layers", 28);
  }
}

}  // namespace config_reading

}  // namespace headroom
