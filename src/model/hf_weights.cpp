#include "model/hf_weights.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>

#include "model/lora.h"
#include "model/safetensors.h"
#include "util/error.h"
#include "util/atomic_file.h"
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
  if (name == "lm_head.weight") return {{"lm_head.weight", t}};  // untied (tie_word_embeddings false)
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

namespace {

// The checkpoint's files: model.safetensors, or the shards its index names.
std::vector<std::string> checkpoint_files(const std::string& dir, const std::string& what) {
  namespace fs = std::filesystem;
  const fs::path root(dir);
  if (!fs::is_directory(root)) {
    fail("{} '{}': not a directory; accepted: a Hugging Face checkpoint directory (config.json and "
         "model.safetensors, or model.safetensors.index.json and its shards)",
         what, dir);
  }
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
  return files;
}


}  // namespace

namespace {

// What a load reads: each file's tensors that map onto parameters, in file and offset order (a tied
// head's copy and buffers are skipped unread). Each mapping is checked from the header alone (on
// meta tensors) against `params` when given: a name it does not know, a parameter it lacks, a shape
// that differs, or one tensor twice is an Error.
struct LoadPlan {
  std::vector<SafetensorsFile> files;
  std::vector<std::pair<size_t, SafetensorsEntry>> reads;  // (file, entry)
};

LoadPlan plan_load(const std::string& dir, const ModelConfig& c, const std::map<std::string, at::Tensor>* params,
                   const std::string& what) {
  LoadPlan plan;
  std::set<std::string> covered;
  for (const std::string& file : checkpoint_files(dir, what)) {
    plan.files.push_back(SafetensorsFile::open(file, what));
    for (const SafetensorsEntry& e : plan.files.back().entries()) {
      if (c.tie_word_embeddings && strip_wrappers(e.name) == "lm_head.weight") continue;  // the embedding's
      const at::Tensor shape_only =
          at::empty(e.shape, at::TensorOptions().dtype(safetensors_scalar_type(e.dtype)).device(at::kMeta));
      Mapped mapped;
      try {
        mapped = headroom_tensors(e.name, shape_only, c);
      } catch (const Error& err) {
        fail("{} '{}': unexpected {}", what, file, err.what());
      }
      if (mapped.empty()) continue;  // a buffer
      plan.reads.emplace_back(plan.files.size() - 1, e);
      if (!params) continue;
      for (auto& [ours, tensor] : mapped) {
        const auto it = params->find(ours);
        if (it == params->end()) {
          fail("{} '{}': unexpected tensor '{}' ({} here): this {} config has no such parameter (a checkpoint of "
               "another configuration?)",
               what, file, e.name, ours, family_name(c.family));
        }
        if (tensor.sizes() != it->second.sizes()) {
          fail("{} '{}': tensor '{}' has shape {}, the model's {} needs {}", what, file, e.name,
               fmt::format("{}", fmt::join(tensor.sizes(), "×")), ours,
               fmt::format("{}", fmt::join(it->second.sizes(), "×")));
        }
        if (!covered.insert(ours).second) fail("{} '{}': tensor '{}' appears twice", what, dir, e.name);
      }
    }
  }
  if (params) {
    for (const auto& [name, tensor] : *params) {
      if (!covered.count(name)) {
        fail("{} '{}': missing tensor for the model's {} (checkpoint of another configuration, or an incomplete "
             "one?)",
             what, dir, name);
      }
    }
  }
  return plan;
}

}  // namespace

void load_hf_weights(const std::string& dir, CausalLM& model, const std::string& what) {
  const ModelConfig& c = model.config();
  // A pipeline stage or a tensor-parallel share: the checkpoint is checked against the whole model's
  // names and shapes (on the meta device), and the part takes what it holds, cut to its share.
  std::optional<CausalLM> whole;
  if (!model.stage().whole(c.num_layers)) {
    whole.emplace(c, model.parameters().front().tensor.options().device(at::kMeta), 0, CausalLM::KeepParameter{},
                  model.finetune());
  }
  std::map<std::string, at::Tensor> held;  // the part's own parameters, by name
  if (whole) {
    for (const auto& p : model.parameters()) held.emplace(p.name, p.tensor);
  }
  std::map<std::string, at::Tensor> params;
  for (const auto& p : (whole ? *whole : model).parameters()) {
    if (is_lora_parameter(p.name)) continue;  // LoRA's come from --adapter, or start anew
    if (is_nf4_part(p.name)) {
      // An NF4 weight is read dense (its shape checked as such) and quantised.
      if (const std::string w = nf4_weight_of_codes(p.name); !w.empty()) {
        params.emplace(w, at::empty(model.nf4_weight(w)->sizes, p.tensor.options().device(at::kMeta)));
      }
      continue;
    }
    params.emplace(p.name, p.tensor);
  }
  // Everything is checked before any parameter changes; then each tensor is read, converted and
  // copied (or quantised) in turn, so that no more than one of them is in memory beside the model.
  const LoadPlan plan = plan_load(dir, c, &params, what);
  const c10::NoGradGuard no_grad;
  auto part_holds = [&](const SafetensorsEntry& e) {
    const at::Tensor shape_only =
        at::empty(e.shape, at::TensorOptions().dtype(safetensors_scalar_type(e.dtype)).device(at::kMeta));
    for (const auto& [ours, t] : headroom_tensors(e.name, shape_only, c)) {
      if (held.contains(ours)) return true;
    }
    return false;
  };
  for (const auto& [file, e] : plan.reads) {
    if (whole && !part_holds(e)) continue;  // another stage's: not read
    for (auto& [ours, tensor] : headroom_tensors(e.name, plan.files[file].load(e.name), c)) {
      if (whole) {
        if (const auto it = held.find(ours); it != held.end()) it->second.copy_(model.share_of(ours, tensor));
      } else if (model.nf4_weight(ours) != nullptr) {
        model.quantise(ours, tensor);
      } else {
        params.at(ours).copy_(tensor);
      }
    }
  }
}

std::vector<int64_t> hf_load_sequence(const std::string& dir, const ModelConfig& config, const std::string& what) {
  std::vector<int64_t> bytes;
  for (const auto& [file, e] : plan_load(dir, config, nullptr, what).reads) bytes.push_back(e.end - e.begin);
  return bytes;
}

namespace {

// The Hugging Face name of one of headroom's parameters, and whether the tensor is stored
// transposed (gpt2's Conv1D).
std::pair<std::string, bool> hf_name(const std::string& ours, const ModelConfig& c) {
  static const std::regex layer(R"(layers\.(\d+)\.(.+))");
  std::smatch m;
  const bool in_layer = std::regex_match(ours, m, layer);
  const std::string n = in_layer ? m[1].str() : "";
  const std::string rest = in_layer ? m[2].str() : ours;
  if (c.family == Family::gpt2) {
    if (ours == "embed_tokens.weight") return {"transformer.wte.weight", false};
    if (ours == "embed_positions.weight") return {"transformer.wpe.weight", false};
    if (ours == "lm_head.weight") return {"lm_head.weight", false};
    if (!in_layer) return {"transformer.ln_f." + ours.substr(ours.rfind('.') + 1), false};
    static const std::map<std::string, std::string> conv = {
        {"input_norm", "ln_1"},       {"post_attention_norm", "ln_2"}, {"attn.qkv", "attn.c_attn"},
        {"attn.o_proj", "attn.c_proj"}, {"mlp.up_proj", "mlp.c_fc"},   {"mlp.down_proj", "mlp.c_proj"}};
    const std::string module = rest.substr(0, rest.rfind('.')), kind = rest.substr(rest.rfind('.') + 1);
    return {fmt::format("transformer.h.{}.{}.{}", n, conv.at(module), kind),
            kind == "weight" && module.find("norm") == std::string::npos};
  }
  if (c.family == Family::gpt_neox) {
    if (ours == "embed_tokens.weight") return {"gpt_neox.embed_in.weight", false};
    if (ours == "lm_head.weight") return {"embed_out.weight", false};
    if (!in_layer) return {"gpt_neox.final_layer_norm." + ours.substr(ours.rfind('.') + 1), false};
    static const std::map<std::string, std::string> conv = {
        {"input_norm", "input_layernorm"},     {"post_attention_norm", "post_attention_layernorm"},
        {"attn.qkv", "attention.query_key_value"}, {"attn.o_proj", "attention.dense"},
        {"mlp.up_proj", "mlp.dense_h_to_4h"},  {"mlp.down_proj", "mlp.dense_4h_to_h"}};
    const std::string module = rest.substr(0, rest.rfind('.')), kind = rest.substr(rest.rfind('.') + 1);
    return {fmt::format("gpt_neox.layers.{}.{}.{}", n, conv.at(module), kind), false};
  }
  if (ours == "embed_tokens.weight") return {"model.embed_tokens.weight", false};
  if (ours == "final_norm.weight") return {"model.norm.weight", false};
  if (!in_layer) return {ours, false};  // lm_head.weight
  const std::string pre = "model.layers." + n + ".";
  const bool outer_norms = c.norm_placement != NormPlacement::pre;
  if (rest == "input_norm.weight") return {pre + "input_layernorm.weight", false};
  if (rest == "post_attention_norm.weight") {
    return {pre + (outer_norms ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight"), false};
  }
  if (rest == "attention_out_norm.weight") return {pre + "post_attention_layernorm.weight", false};
  if (rest == "mlp_out_norm.weight") return {pre + "post_feedforward_layernorm.weight", false};
  if (rest.rfind("attn.qkv.", 0) == 0) return {pre + "self_attn.qkv_proj." + rest.substr(9), false};
  if (rest.rfind("attn.", 0) == 0) return {pre + "self_attn." + rest.substr(5), false};
  const bool mixtral = c.family == Family::mixtral;
  if (rest == "mlp.router.weight") return {pre + (mixtral ? "block_sparse_moe.gate.weight" : "mlp.gate.weight"), false};
  static const std::regex expert(R"(mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight)");
  std::smatch e;
  if (mixtral && std::regex_match(rest, e, expert)) {
    const std::string w = e[2] == "gate_proj" ? "w1" : e[2] == "up_proj" ? "w3" : "w2";
    return {fmt::format("{}block_sparse_moe.experts.{}.{}.weight", pre, e[1].str(), w), false};
  }
  return {pre + rest, false};
}

const char* hf_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return "float32";
  }
}

}  // namespace

std::string hf_parameter_name(const std::string& ours, const ModelConfig& config) {
  if (is_lora_parameter(ours)) {
    const bool a = ours.find(".lora_A.") != std::string::npos;
    const std::string base = ours.substr(0, ours.find(a ? ".lora_A." : ".lora_B.")) + ".weight";
    const std::string module = hf_name(base, config).first;
    return module.substr(0, module.size() - 7) + (a ? ".lora_A.weight" : ".lora_B.weight");
  }
  return hf_name(ours, config).first;
}

std::vector<std::pair<std::string, at::Tensor>> hf_checkpoint_tensors(const CausalLM& model, bool merge_lora) {
  const ModelConfig& c = model.config();
  if (!model.nf4_weights().empty()) {
    fail("a checkpoint of a 4-bit (--base-weights nf4) base is not written; accepted: --save-weights with LoRA, "
         "which writes the adapter");
  }
  std::map<std::string, LoraAdapter> adapted;
  if (merge_lora)
    for (const auto& a : model.adapters()) adapted.emplace(a.weight, a.adapter);
  const double scale = model.finetune().lora.scale();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : model.parameters()) {
    if (is_lora_parameter(p.name)) continue;
    at::Tensor t = p.tensor.detach();
    if (const auto it = adapted.find(p.name); it != adapted.end()) {
      // W + (alpha / r) · B A, computed in float32 and stored in the weight's dtype, as peft merges
      const at::Tensor delta = at::matmul(it->second.b.detach().to(at::kFloat), it->second.a.detach().to(at::kFloat));
      t = (t.to(at::kFloat) + delta * scale).to(t.scalar_type());
    }
    const auto [name, transposed] = hf_name(p.name, c);
    out.emplace_back(name, transposed ? t.t() : t);
  }
  return out;
}

void check_hf_savable(const ModelConfig& config, const std::string& what) {
  if (config.source.value("model_type", nlohmann::json()) == "gemma3") {
    fail("{}: a multimodal gemma3 config (its text_config) saves only its language model, which transformers "
         "loads as gemma3_text; accepted: --model with model_type gemma3_text",
         what);
  }
}

void save_hf_weights(const std::string& dir, const CausalLM& model, bool merge_lora, const std::string& what) {
  namespace fs = std::filesystem;
  const ModelConfig& c = model.config();
  check_hf_savable(c, what);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) fail("{} '{}': cannot create the directory ({})", what, dir, ec.message());
  const auto tensors = hf_checkpoint_tensors(model, merge_lora);
  nlohmann::json config = c.source;
  const at::ScalarType dtype = tensors.empty() ? at::kFloat : tensors.front().second.scalar_type();
  config["dtype"] = hf_dtype_name(dtype);
  if (config.contains("torch_dtype")) config["torch_dtype"] = hf_dtype_name(dtype);
  // The weights first, then the config that makes the directory a checkpoint: a save cut short
  // leaves no config.json beside the old weights.
  write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}}, what);
  write_file_atomically((fs::path(dir) / "config.json").string(), config.dump(2) + "\n", what);
}

}  // namespace headroom
