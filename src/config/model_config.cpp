#include "config/model_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>

#include <cmath>
#include <optional>
#include <set>

#include "config/field_reader.h"
#include "config/family_readers.h"
#include "data/embedded.h"
#include "util/error.h"
#include "util/files.h"
#include "util/json.h"

namespace headroom {

using nlohmann::json;


namespace {

using namespace config_reading;

// llama, mistral and qwen2 share one layout; they differ in biases and defaults.
void read_llama_like(FieldReader& r, ModelConfig& c, const std::string& origin) {
  read_decoder_core(r, c, origin);
  switch (c.family) {
    case Family::llama:
      c.qkv_bias = c.out_bias = r.boolean_or("attention_bias", false);
      c.mlp_bias = r.boolean_or("mlp_bias", false);
      break;
    case Family::mistral:
      // MistralConfig: a missing sliding_window means its default, 4096; an explicit null means none.
      if (r.has("sliding_window")) {
        c.sliding_window = r.integer("sliding_window");
      } else if (!r.present("sliding_window")) {
        c.sliding_window = 4096;
      }
      break;
    case Family::qwen2:
      c.qkv_bias = true;  // Qwen2Attention: q/k/v carry a bias, o_proj does not
      read_qwen_window(r, c);
      break;
    default: break;
  }
}

void read_gpt2(FieldReader& r, ModelConfig& c, const std::string& origin) {
  c.vocab_size = r.integer("vocab_size");
  c.hidden_size = r.integer("n_embd");
  c.num_layers = r.integer("n_layer");
  c.num_heads = r.integer("n_head");
  c.max_positions = r.integer("n_positions");
  c.num_kv_heads = c.num_heads;
  c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;
  c.intermediate_size = r.integer_or("n_inner", 4 * c.hidden_size);
  c.norm = NormKind::layer_norm;
  c.norm_bias = true;
  c.norm_eps = r.number_or("layer_norm_epsilon", 1e-5);
  c.activation = parse_activation(r.string_or("activation_function", "gelu_new"), origin);
  c.gated_mlp = false;
  c.learned_positions = true;
  c.qkv_bias = c.out_bias = c.mlp_bias = true;
  c.fused_qkv = true;
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", true);
  c.embd_dropout = r.number_or("embd_pdrop", 0.1);
  c.attn_dropout = r.number_or("attn_pdrop", 0.1);
  c.resid_dropout = r.number_or("resid_pdrop", 0.1);
  c.initializer_range = r.number_or("initializer_range", 0.02);
  // Variants of GPT-2 attention that this model does not implement: refuse rather than ignore.
  if (r.boolean_or("scale_attn_by_inverse_layer_idx", false)) {
    fail("{}: scale_attn_by_inverse_layer_idx = true is not supported (only false)", origin);
  }
  if (!r.boolean_or("scale_attn_weights", true)) fail("{}: scale_attn_weights = false is not supported", origin);
  r.boolean_or("reorder_and_upcast_attn", false);  // numerics only: softmax is in float32 here anyway
}

void read_gpt_neox(FieldReader& r, ModelConfig& c, const std::string& origin) {
  read_sizes(r, c);
  c.num_kv_heads = c.num_heads;
  c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;
  c.norm = NormKind::layer_norm;
  c.norm_bias = true;
  c.norm_eps = r.number_or("layer_norm_eps", 1e-5);
  c.activation = parse_activation(r.string_or("hidden_act", "gelu"), origin);
  c.gated_mlp = false;
  const double pct = r.number_or("rotary_pct", rope_parameter(r, "partial_rotary_factor", 0.25, origin));
  if (pct <= 0 || pct > 1)
    fail("{}: the rotary fraction (rotary_pct or rope_parameters.partial_rotary_factor) must be in (0, 1], got {}",
         origin, pct);
  c.rotary_dim = static_cast<int64_t>(c.head_dim * pct);  // HF: int(head_size * rotary_pct)
  c.rope_theta = r.number_or("rotary_emb_base", rope_parameter(r, "rope_theta", 10000.0, origin));
  read_rope_scaling(r, c, origin);
  c.qkv_bias = c.out_bias = r.boolean_or("attention_bias", true);
  c.mlp_bias = true;
  c.fused_qkv = true;
  c.parallel_residual = r.boolean_or("use_parallel_residual", true);
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);
  c.attn_dropout = r.number_or("attention_dropout", 0.0);
  c.resid_dropout = r.number_or("hidden_dropout", 0.0);
  c.embd_dropout = c.resid_dropout;  // GPTNeoXModel applies hidden_dropout to the embeddings too
  c.initializer_range = r.number_or("initializer_range", 0.02);
}

void validate(const ModelConfig& c, const std::string& origin) {
  auto positive = [&](const char* field, int64_t v) {
    if (v <= 0) fail("{}: {} must be positive, got {}", origin, field, v);
  };
  positive("vocab_size", c.vocab_size);
  positive("hidden size", c.hidden_size);
  positive("number of layers", c.num_layers);
  positive("number of attention heads", c.num_heads);
  positive("number of key/value heads", c.num_kv_heads);
  positive("intermediate size", c.intermediate_size);
  positive("max position embeddings", c.max_positions);
  positive("head dim", c.head_dim);
  // A size this large cannot be meant; it would also overflow the byte arithmetic downstream.
  if (c.vocab_size > (int64_t{1} << 24) || c.hidden_size > (int64_t{1} << 20) || c.num_layers > 10000 ||
      c.intermediate_size > (int64_t{1} << 22) || c.num_heads > 65536 || c.num_kv_heads > c.num_heads ||
      c.head_dim > 65536 || c.max_positions > (int64_t{1} << 24)) {
    fail(
        "{}: sizes out of range (vocab_size <= 16M, hidden size <= 1M, layers <= 10000, intermediate size "
        "<= 4M, heads <= 65536, key/value heads <= heads, head dim <= 65536, max positions <= 16M)",
        origin);
  }
  if (c.moe) {
    const MoeConfig& m = *c.moe;
    positive("number of experts", m.experts);
    positive("experts per token", m.top_k);
    positive("expert intermediate size", m.intermediate_size);
    positive("decoder_sparse_step", m.sparse_step);
    if (m.experts > 65536 || m.top_k > m.experts || m.intermediate_size > (int64_t{1} << 22)) {
      fail("{}: {} experts, {} per token, expert intermediate size {}: accepted 1 <= experts per token <= experts "
           "<= 65536, expert intermediate size <= 4M",
           origin, m.experts, m.top_k, m.intermediate_size);
    }
  }
  {
    // The parameter count in floating point, so that an absurd combination cannot overflow.
    const double d = static_cast<double>(c.hidden_size), q = static_cast<double>(c.num_heads * c.head_dim);
    const double kv = static_cast<double>(c.num_kv_heads * c.head_dim), i = static_cast<double>(c.intermediate_size);
    const double mlp = c.moe ? static_cast<double>(c.moe->experts) * 3 * d * static_cast<double>(c.moe->intermediate_size)
                             : 3 * d * i;
    const double params = static_cast<double>(c.num_layers) * (d * (q + 2 * kv) + q * d + mlp) +
                          2 * static_cast<double>(c.vocab_size) * d + static_cast<double>(c.max_positions) * d;
    if (params > 1e15) {
      fail("{}: the sizes make about {:.3g} parameters; accepted: at most 10^15", origin, params);
    }
  }
  // Families whose head size is derived (hidden size / heads) rather than given.
  const bool derived_head = c.family == Family::gpt2 || c.family == Family::gpt_neox || c.family == Family::phi3;
  if (derived_head && c.head_dim * c.num_heads != c.hidden_size) {
    fail("{}: hidden size {} is not divisible by {} attention heads", origin, c.hidden_size, c.num_heads);
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    fail("{}: {} attention heads are not a multiple of {} key/value heads", origin, c.num_heads, c.num_kv_heads);
  }
  if (!c.learned_positions && (c.rotary_dim <= 0 || c.rotary_dim % 2 != 0 || c.rotary_dim > c.head_dim)) {
    fail("{}: rotary dimension {} must be even and in (0, head dim {}]", origin, c.rotary_dim, c.head_dim);
  }
  for (double p : {c.embd_dropout, c.attn_dropout, c.resid_dropout}) {
    if (p < 0 || p >= 1) fail("{}: dropout probabilities must be in [0, 1), got {}", origin, p);
  }
  if (c.norm_eps <= 0) fail("{}: the norm epsilon must be positive, got {}", origin, c.norm_eps);
  if (!c.learned_positions && !(c.rope_theta > 0)) {
    fail("{}: the rotary base (rope_theta) must be positive, got {}", origin, c.rope_theta);
  }
  if (c.sliding_window && *c.sliding_window <= 0) {
    fail("{}: sliding_window must be positive, got {}", origin, *c.sliding_window);
  }
}

json parse_override_value(const std::string& text) {
  json v = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) return json(text);
  return v;
}

std::string read_text_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    fail("--model: cannot read '{}' (not a preset name and not a readable file); presets: {}", path,
         fmt::join(preset_names(), ", "));
  }
  // A checkpoint's directory: its config.json.
  if (S_ISDIR(st.st_mode)) {
    const std::string inner = path + "/config.json";
    if (::stat(inner.c_str(), &st) != 0) {
      fail("--model '{}': a directory without a config.json; accepted: a preset, a config.json, or a Hugging Face "
           "checkpoint directory holding one",
           path);
    }
    return read_file(inner, "--model", int64_t{16} << 20);
  }
  return read_file(path, "--model", int64_t{16} << 20);
}

}  // namespace

namespace {

// The families: model_type, the family, and its reader. A new family is a row here and a reader
// (config/families/).
struct FamilyRow {
  const char* model_type;
  Family family;
  void (*read)(FieldReader&, ModelConfig&, const std::string&);
};

const std::vector<FamilyRow>& family_table() {
  static const std::vector<FamilyRow> rows = {
      {"gpt2", Family::gpt2, read_gpt2},
      {"llama", Family::llama, read_llama_like},
      {"mistral", Family::mistral, read_llama_like},
      {"qwen2", Family::qwen2, read_llama_like},
      {"gpt_neox", Family::gpt_neox, read_gpt_neox},
      {"qwen3", Family::qwen3, read_qwen3},
      {"qwen3_moe", Family::qwen3_moe, read_qwen3},
      {"mixtral", Family::mixtral, read_mixtral},
      {"gemma3_text", Family::gemma3, read_gemma3},
      {"phi3", Family::phi3, read_phi3},
      {"olmo2", Family::olmo2, read_olmo2},
      {"smollm3", Family::smollm3, read_smollm3},
  };
  return rows;
}

}  // namespace

const char* family_name(Family family) {
  for (const auto& row : family_table()) {
    if (row.family == family) return row.model_type;
  }
  return "?";
}

std::vector<std::string> supported_families() {
  std::vector<std::string> names;
  for (const auto& row : family_table()) names.emplace_back(row.model_type);
  names.emplace_back("gemma3");  // its text_config
  return names;
}

bool ModelConfig::windowed(int64_t layer) const {
  if (!sliding_window) return false;
  if (!sliding_layers.empty()) return sliding_layers.at(static_cast<size_t>(layer));
  return layer >= window_from_layer;
}

bool ModelConfig::rotated(int64_t layer) const {
  if (learned_positions) return false;
  return rope_layers.empty() || rope_layers.at(static_cast<size_t>(layer));
}

bool ModelConfig::sparse(int64_t layer) const {
  if (!moe) return false;
  for (int64_t d : moe->dense_layers) {
    if (d == layer) return false;
  }
  return (layer + 1) % moe->sparse_step == 0;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : embedded_presets()) names.emplace_back(p.name);
  return names;
}

namespace {

// Reads and validates; `fields` receives every field name a reader consulted.
ModelConfig read_config(const nlohmann::json& j, const std::string& origin, std::set<std::string>* fields) {
  if (!j.is_object()) fail("{}: a model config must be a JSON object", origin);
  if (!j.contains("model_type")) {
    fail("{}: missing field 'model_type'; supported: {}", origin, fmt::join(supported_families(), ", "));
  }
  if (!j.at("model_type").is_string()) {
    fail("{}: field 'model_type' must be a string naming the family, got {}; supported: {}", origin,
         dump_json(j.at("model_type")), fmt::join(supported_families(), ", "));
  }
  const std::string type = j.at("model_type").get<std::string>();
  if (type == "gemma3") {
    // The multimodal config: headroom trains its language model, text_config.
    if (!j.contains("text_config") || !j.at("text_config").is_object()) {
      fail("{}: a gemma3 config needs its text_config object (the language model headroom trains)", origin);
    }
    json text = j.at("text_config");
    text["model_type"] = "gemma3_text";
    if (j.contains("tie_word_embeddings") && !text.contains("tie_word_embeddings")) {
      text["tie_word_embeddings"] = j.at("tie_word_embeddings");
    }
    ModelConfig c = read_config(text, origin, fields);
    c.source = j;
    return c;
  }
  ModelConfig c;
  c.name = origin;
  c.source = j;
  FieldReader r(j, origin, type);
  const FamilyRow* row = nullptr;
  for (const auto& candidate : family_table()) {
    if (type == candidate.model_type) row = &candidate;
  }
  if (!row) {
    fail("{}: model_type '{}' is not native to headroom (native: {}); any transformers model: python -m headroom "
         "estimate|plan --model {} (the Python package, with transformers installed)", origin, type,
         fmt::join(supported_families(), ", "), origin);
  }
  c.family = row->family;
  row->read(r, c, origin);
  validate(c, origin);
  if (fields) *fields = r.used();
  return c;
}

}  // namespace

ModelConfig model_config_from_json(const nlohmann::json& j, const std::string& origin) {
  return read_config(j, origin, nullptr);
}

ModelConfig load_model_config(const std::string& model, const std::vector<std::string>& overrides) {
  std::string text;
  std::string origin = model;
  bool found = false;
  for (const auto& p : embedded_presets()) {
    if (p.name == model) {
      text = std::string(p.json);
      found = true;
    }
  }
  if (!found) text = read_text_file(model);
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (j.is_discarded()) fail("{}: not valid JSON", origin);
  if (!j.is_object()) fail("{}: a model config must be a JSON object", origin);

  std::vector<std::string> keys;
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      fail("--set '{}': expected key=value, e.g. --set num_hidden_layers=2", o);
    }
    const std::string key = o.substr(0, eq);
    // A multimodal gemma3 config: the overrides are its language model's (text_config).
    const bool nested = j.value("model_type", json()) == "gemma3" && j.contains("text_config") &&
                        j.at("text_config").is_object() && key != "model_type";
    (nested ? j["text_config"] : j)[key] = parse_override_value(o.substr(eq + 1));
    keys.push_back(key);
  }
  std::set<std::string> fields;
  ModelConfig c = read_config(j, origin, &fields);
  // Refuse overrides that no reader consulted: a typo must not be silently ignored.
  for (const auto& key : keys) {
    if (key != "model_type" && !fields.count(key)) {
      fail("--set {}: model_type '{}' has no field '{}'; its fields: {}", key, family_name(c.family), key,
           fmt::join(fields, ", "));
    }
  }
  return c;
}

int64_t count_parameters(const ModelConfig& c) {
  const int64_t d = c.hidden_size;
  const int64_t q_dim = c.num_heads * c.head_dim;
  const int64_t kv_dim = c.num_kv_heads * c.head_dim;
  const int64_t norm = c.norm_bias ? 2 * d : d;
  int64_t attn = d * (q_dim + 2 * kv_dim) + q_dim * d;
  if (c.qkv_bias) attn += q_dim + 2 * kv_dim;
  if (c.out_bias) attn += d;
  if (c.qk_norm == QkNorm::per_head) attn += 2 * c.head_dim;
  if (c.qk_norm == QkNorm::whole) attn += q_dim + kv_dim;
  const int64_t i = c.intermediate_size;
  int64_t dense = c.gated_mlp ? 3 * d * i : 2 * d * i;
  if (c.mlp_bias) dense += c.gated_mlp ? 2 * i + d : i + d;
  const int64_t norms = (c.norm_placement == NormPlacement::sandwich ? 4 : 2) * norm;
  int64_t total = c.vocab_size * d + norm;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const int64_t mlp = c.sparse(layer) ? c.moe->experts * (3 * d * c.moe->intermediate_size + d) : dense;
    total += attn + mlp + norms;
  }
  if (c.learned_positions) total += c.max_positions * d;
  if (!c.tie_word_embeddings) total += c.vocab_size * d;
  return total;
}

}  // namespace headroom
