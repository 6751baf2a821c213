// FieldReader — reads one config.json's fields for a family's reader, remembering which it
// consulted (an override of a field no reader looks at is refused, not silently ignored), and the
// readers' shared helpers: activations, rotary settings, the llama-like core every decoder family
// since Llama shares. Internal to config/: model_config.cpp and config/families/*.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>

#include "config/model_config.h"
#include "util/error.h"
#include "util/json.h"

namespace headroom::config_reading {

using nlohmann::json;

class FieldReader {
 public:
  FieldReader(const json& j, std::string origin, std::string type)
      : j_(j), origin_(std::move(origin)), type_(std::move(type)) {}

  bool has(const std::string& key) {
    used_.insert(key);
    return j_.contains(key) && !j_.at(key).is_null();
  }
  // Present at all, null included.
  bool present(const std::string& key) {
    used_.insert(key);
    return j_.contains(key);
  }
  int64_t integer(const std::string& key) {
    if (!has(key)) fail("{}: missing field '{}' (required for model_type '{}')", origin_, key, type_);
    return as_int(key);
  }
  int64_t integer_or(const std::string& key, int64_t fallback) { return has(key) ? as_int(key) : fallback; }
  double number_or(const std::string& key, double fallback) {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    if (!v.is_number()) fail("{}: field '{}' must be a number, got {}", origin_, key, dump_json(v));
    return v.get<double>();
  }
  bool boolean_or(const std::string& key, bool fallback) {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    if (!v.is_boolean()) fail("{}: field '{}' must be true or false, got {}", origin_, key, dump_json(v));
    return v.get<bool>();
  }
  std::string string_or(const std::string& key, const std::string& fallback) {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    if (!v.is_string()) fail("{}: field '{}' must be a string, got {}", origin_, key, dump_json(v));
    return v.get<std::string>();
  }
  const json& raw(const std::string& key) {
    used_.insert(key);
    return j_.at(key);
  }
  const std::set<std::string>& used() const { return used_; }

 private:
  // Sizes and counts: integers up to 2^40, so that products of them (parameter counts, bytes) stay
  // far from int64's range.
  int64_t as_int(const std::string& key) {
    constexpr int64_t kLimit = int64_t{1} << 40;
    const json& v = j_.at(key);
    std::optional<int64_t> n;
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() <= static_cast<uint64_t>(kLimit)) n = static_cast<int64_t>(v.get<uint64_t>());
    } else if (v.is_number_integer()) {
      n = v.get<int64_t>();
    } else if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::abs(d) <= static_cast<double>(kLimit) && d == std::floor(d)) n = static_cast<int64_t>(d);
    }
    if (v.is_number() && (!n || std::abs(*n) > kLimit)) {
      fail("{}: field '{}' is out of range: {}; accepted: an integer of at most 2^40", origin_, key, dump_json(v));
    }
    if (!n) fail("{}: field '{}' must be an integer, got {}", origin_, key, dump_json(v));
    return *n;
  }

  const json& j_;
  std::string origin_;
  std::string type_;
  std::set<std::string> used_;
};

// The sizes every decoder's config.json names alike: vocab_size, hidden_size, num_hidden_layers,
// num_attention_heads, intermediate_size, max_position_embeddings.
void read_sizes(FieldReader& r, ModelConfig& c);

Activation parse_activation(const std::string& name, const std::string& origin);
// A rotary setting from rope_parameters (transformers 5), else `fallback`.
double rope_parameter(FieldReader& r, const char* key, double fallback, const std::string& origin);
// rope_parameters / rope_scaling's frequency scaling (default, linear, llama3) into c.rope_scaling.
void read_rope_scaling(FieldReader& r, ModelConfig& c, const std::string& origin);
// A rotary object's frequency scaling (nullopt for rope_type default); `object` names it in errors.
std::optional<RopeScaling> rope_scaling_from(const json& s, const std::string& object, const std::string& origin);
// A number in a rotary object, else `fallback`.
double rope_number(const json& s, const std::string& object, const char* key, double fallback,
                   const std::string& origin);
// The fields Llama introduced and its descendants keep: sizes, RMS norm, gated MLP, rotary,
// attention dropout, initialiser range, tied head; `default_theta`: the family's rotary base when
// the config names none.
void read_decoder_core(FieldReader& r, ModelConfig& c, const std::string& origin, double default_theta = 10000.0,
                       const char* activation_key = "hidden_act");
// transformers 5's layer_types ("sliding_attention" / "full_attention" per layer) into
// c.sliding_layers; false when the config has none. A list longer than the layers (a config shrunk
// with --set num_hidden_layers) is cut to them.
bool read_layer_types(FieldReader& r, ModelConfig& c, const std::string& origin);
// Qwen2/Qwen3's window: layers from max_window_layers on, only when use_sliding_window is set.
void read_qwen_window(FieldReader& r, ModelConfig& c);

}  // namespace headroom::config_reading
