#include "model/hf_weights.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "train/safetensors.h"
#include "util/error.h"
#include "util/files.h"

namespace headroom {
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A multimodal checkpoint's language model, under the names of a causal LM's.
std::string strip_wrappers(std::string name) {
  for (const auto& [from, to] : {std::pair<std::string, std::string>{"model.language_model.", "model."},
                                 {"language_model.model.", "model."},
                                 {"language_model.lm_head.", "lm_head."}}) {
    if (name.rfind(from, 0) == 0) return to + name.substr(from.size());
  }
  return name;
}

// Buffers that older checkpoints saved beside the parameters.
bool is_buffer(const std::string& name) {
  return ends_with(name, ".rotary_emb.inv_freq") || ends_with(name, ".attn.bias") ||
         ends_with(name, ".attn.masked_bias") || ends_with(name, ".attention.bias") ||
         ends_with(name, ".attention.masked_bias");
}

using Mapped = std::vector<std::pair<std::string, at::Tensor>>;

Mapped gpt2(const std::string& in, const at::Tensor& t) {
  const std::string name = in.rfind("transformer.", 0) == 0 ? in.substr(12) : in;
  if (name == "wte.weight") return {{"embed_tokens.weight", t}};
  if (name == "wpe.weight") return {{"embed_positions.weight", t}};
  if (name == "ln_f.weight" || name == "ln_f.bias") return {{"final_norm." + name.substr(5), t}};
  static const std::regex layer(R"(h\.(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias))");
  std::smatch m;
  if (!std::regex_match(name, m, layer)) return {};
  static const std::map<std::string, std::string> conv = {
      {"ln_1", "input_norm"},       {"ln_2", "post_attention_norm"}, {"attn.c_attn", "attn.qkv"},
      {"attn.c_proj", "attn.o_proj"}, {"mlp.c_fc", "mlp.up_proj"},   {"mlp.c_proj", "mlp.down_proj"}};
  const bool conv1d = m[3] == "weight" && m[2].str().rfind("ln_", 0) != 0;  // Conv1D keeps [in, out]
  return {{fmt::format("layers.{}.{}.{}", m[1].str(), conv.at(m[2]), m[3].str()), conv1d ? t.t() : t}};
}

Mapped gpt_neox(const std::string& name, const at::Tensor& t) {
  if (name == "gpt_neox.embed_in.weight") return {{"embed_tokens.weight", t}};
  if (name == "embed_out.weight") return {{"lm_head.weight", t}};
  const std::string final_norm = "gpt_neox.final_layer_norm.";
  if (name.rfind(final_norm, 0) == 0) return {{"final_norm." + name.substr(final_norm.size()), t}};
  static const std::regex layer(R"(gpt_neox\.layers\.(\d+)\.(.*)\.(weight|bias))");
  std::smatch m;
  if (!std::regex_match(name, m, layer)) return {};
  static const std::map<std::string, std::string> conv = {
      {"input_layernorm", "input_norm"},     {"post_attention_layernorm", "post_attention_norm"},
      {"attention.query_key_value", "attn.qkv"}, {"attention.dense", "attn.o_proj"},
      {"mlp.dense_h_to_4h", "mlp.up_proj"},  {"mlp.dense_4h_to_h", "mlp.down_proj"}};
  const auto it = conv.find(m[2]);
  if (it == conv.end()) return {};
  return {{fmt::format("layers.{}.{}.{}", m[1].str(), it->second, m[3].str()), t}};
}

// Llama and its descendants: model.layers.N.(self_attn|mlp|...).
Mapped llama_like(const std::string& name, const at::Tensor& t, const ModelConfig& c) {
  if (name == "model.embed_tokens.weight") return {{"embed_tokens.weight", t}};
  if (name == "model.norm.weight") return {{"final_norm.weight", t}};
  if (name == "lm_head.weight") return {{"lm_head.weight", t}};
  static const std::regex layer(R"(model\.layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(name, m, layer)) return {};
  const std::string pre = "layers." + m[1].str() + ".";
  std::string rest = m[2];
  std::smatch e;
  // Experts as transformers 5 holds them: [E, 2I, d] gate rows then up rows, and [E, d, I].
  if (rest == "mlp.experts.gate_up_proj" || rest == "mlp.experts.down_proj") {
    Mapped out;
    const bool down = rest == "mlp.experts.down_proj";
    for (int64_t x = 0; x < t.size(0); ++x) {
      const std::string ep = fmt::format("{}mlp.experts.{}.", pre, x);
      if (down) {
        out.push_back({ep + "down_proj.weight", t[x]});
      } else {
        auto halves = t[x].chunk(2, 0);
        out.push_back({ep + "gate_proj.weight", halves[0]});
        out.push_back({ep + "up_proj.weight", halves[1]});
      }
    }
    return out;
  }
  // Mixtral's hub layout: block_sparse_moe.{gate, experts.E.w1 (gate) / w3 (up) / w2 (down)}.
  static const std::regex mixtral_expert(R"(block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight)");
  if (std::regex_match(rest, e, mixtral_expert)) {
    const std::string which = e[2] == "w1" ? "gate_proj" : e[2] == "w3" ? "up_proj" : "down_proj";
    return {{fmt::format("{}mlp.experts.{}.{}.weight", pre, e[1].str(), which), t}};
  }
  if (rest == "block_sparse_moe.gate.weight" || (rest == "mlp.gate.weight" && c.sparse(std::stoll(m[1])))) {
    return {{pre + "mlp.router.weight", t}};
  }
  const bool outer_norms = c.norm_placement != NormPlacement::pre;
  const std::map<std::string, std::string> norms = {
      {"input_layernorm.weight", "input_norm.weight"},
      {"post_attention_layernorm.weight", outer_norms ? "attention_out_norm.weight" : "post_attention_norm.weight"},
      {"pre_feedforward_layernorm.weight", "post_attention_norm.weight"},
      {"post_feedforward_layernorm.weight", "mlp_out_norm.weight"}};
  if (const auto it = norms.find(rest); it != norms.end()) return {{pre + it->second, t}};
  if (rest.rfind("self_attn.qkv_proj.", 0) == 0) return {{pre + "attn.qkv." + rest.substr(19), t}};
  if (rest.rfind("self_attn.", 0) == 0) return {{pre + "attn." + rest.substr(10), t}};
  if (rest.rfind("mlp.", 0) == 0) return {{pre + rest, t}};
  return {};
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> headroom_tensors(const std::string& hf_name, const at::Tensor& t,
                                                                 const ModelConfig& config) {
  const std::string name = strip_wrappers(hf_name);
  if (is_buffer(name)) return {};
  Mapped out;
  switch (config.family) {
    case Family::gpt2: out = gpt2(name, t); break;
    case Family::gpt_neox: out = gpt_neox(name, t); break;
    default: out = llama_like(name, t, config); break;
  }
  if (out.empty()) fail("tensor '{}' is not a parameter of a {} model", hf_name, family_name(config.family));
  return out;
}

void load_hf_weights(const std::string& dir, CausalLM& model, const std::string& what) {
  namespace fs = std::filesystem;
  const fs::path root(dir);
  // The files and which tensors each holds: one file, or the shards an index names.
  std::vector<std::string> files;
  if (fs::exists(root / "model.safetensors.index.json")) {
    const auto index = nlohmann::json::parse(
        read_file((root / "model.safetensors.index.json").string(), what, int64_t{64} << 20), nullptr, false);
    if (index.is_discarded() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      fail("{} '{}': model.safetensors.index.json needs a weight_map object", what, dir);
    }
    std::set<std::string> seen;
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
        fail("{} '{}': the index maps '{}' to {}; accepted: a file name in the directory", what, dir, name,
             file.dump());
      }
      if (seen.insert(file.get<std::string>()).second) files.push_back((root / file.get<std::string>()).string());
    }
  } else if (fs::exists(root / "model.safetensors")) {
    files.push_back((root / "model.safetensors").string());
  } else {
    fail("{} '{}': no model.safetensors or model.safetensors.index.json there (a Hugging Face checkpoint saved "
         "with safe_serialization, the default)",
         what, dir);
  }

  const ModelConfig& c = model.config();
  std::map<std::string, at::Tensor> params;
  for (const auto& p : model.parameters()) params.emplace(p.name, p.tensor);
  // Everything is read and checked before any parameter changes.
  std::map<std::string, at::Tensor> loaded;
  for (const std::string& file : files) {
    const SafetensorsFile f = SafetensorsFile::open(file, what);
    for (const SafetensorsEntry& e : f.entries()) {
      if (c.tie_word_embeddings && strip_wrappers(e.name) == "lm_head.weight") continue;  // the embedding's
      const at::Tensor raw = f.load(e.name);
      Mapped mapped;
      try {
        mapped = headroom_tensors(e.name, raw, c);
      } catch (const Error& err) {
        fail("{} '{}': unexpected {}", what, file, err.what());
      }
      for (auto& [ours, tensor] : mapped) {
        const auto it = params.find(ours);
        if (it == params.end()) {
          fail("{} '{}': unexpected tensor '{}' ({} here): this {} config has no such parameter (a checkpoint of "
               "another configuration?)",
               what, file, e.name, ours, family_name(c.family));
        }
        if (tensor.sizes() != it->second.sizes()) {
          fail("{} '{}': tensor '{}' has shape {}, the model's {} needs {}", what, file, e.name,
               fmt::format("{}", fmt::join(tensor.sizes(), "×")), ours,
               fmt::format("{}", fmt::join(it->second.sizes(), "×")));
        }
        if (!loaded.emplace(ours, tensor).second) fail("{} '{}': tensor '{}' appears twice", what, dir, e.name);
      }
    }
  }
  for (const auto& [name, tensor] : params) {
    if (!loaded.count(name)) {
      fail("{} '{}': missing tensor for the model's {} (checkpoint of another configuration, or an incomplete "
           "one?)",
           what, dir, name);
    }
  }
  const c10::NoGradGuard no_grad;
  for (auto& [name, tensor] : params) tensor.copy_(loaded.at(name));
}

}  // namespace headroom
