#include "model/peft_adapter.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "model/hf_weights.h"
#include "model/safetensors.h"
#include "util/atomic_file.h"
#include "util/error.h"
#include "util/files.h"

namespace headroom {
namespace {

const std::string kPrefix = "base_model.model.";

// The adapter tensors of `model` under peft's names.
std::map<std::string, at::Tensor> peft_tensors(const CausalLM& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model.parameters()) {
    if (!is_lora_parameter(p.name)) continue;
    out.emplace(kPrefix + hf_parameter_name(p.name, model.config()), p.tensor);
  }
  return out;
}

// peft's target_modules: each adapted module's last two path components ("self_attn.q_proj",
// "attn.c_attn"), which peft matches as a suffix of the module's name.
std::vector<std::string> target_modules(const CausalLM& model) {
  std::set<std::string> out;
  for (const auto& a : model.adapters()) {
    std::string module = hf_parameter_name(a.weight, model.config());
    module = module.substr(0, module.size() - std::string(".weight").size());
    const auto last = module.rfind('.');
    out.insert(module.substr(module.rfind('.', last - 1) + 1));
  }
  return {out.begin(), out.end()};
}

}  // namespace

void save_peft_adapter(const std::string& dir, const CausalLM& model, const std::string& base,
                       const std::string& what) {
  namespace fs = std::filesystem;
  if (!model.finetune().is_lora()) fail("{}: the model has no LoRA adapters to save", what);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) fail("{} '{}': cannot create the directory ({})", what, dir, ec.message());
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto& [name, t] : peft_tensors(model)) tensors.emplace_back(name, t.detach());
  const LoraSettings& lora = model.finetune().lora;
  const nlohmann::json config = {{"peft_type", "LORA"},
                                 {"task_type", "CAUSAL_LM"},
                                 {"base_model_name_or_path", base},
                                 {"r", lora.r},
                                 {"lora_alpha", lora.alpha},
                                 {"lora_dropout", lora.dropout},
                                 {"target_modules", target_modules(model)},
                                 {"bias", "none"},
                                 {"fan_in_fan_out", model.config().family == Family::gpt2},
                                 {"inference_mode", true},
                                 {"init_lora_weights", true},
                                 {"use_rslora", false},
                                 {"use_dora", false},
                                 {"modules_to_save", nullptr}};
  write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}}, what);
  write_file_atomically((fs::path(dir) / "adapter_config.json").string(), config.dump(2) + "\n", what);
}

void load_peft_adapter(const std::string& dir, CausalLM& model, const std::string& what) {
  namespace fs = std::filesystem;
  const fs::path root(dir);
  if (!fs::is_regular_file(root / "adapter_config.json") || !fs::is_regular_file(root / "adapter_model.safetensors")) {
    fail("{} '{}': no adapter_config.json and adapter_model.safetensors there (a peft LoRA adapter, as "
         "save_pretrained writes it)",
         what, dir);
  }
  if (!model.finetune().is_lora()) {
    fail("{} needs --finetune lora:r=R,... with the adapter's rank and targets", what);
  }
  const auto config =
      nlohmann::json::parse(read_file((root / "adapter_config.json").string(), what, int64_t{1} << 20), nullptr, false);
  if (config.is_discarded() || !config.is_object()) fail("{} '{}': adapter_config.json is not a JSON object", what, dir);
  if (config.value("peft_type", std::string()) != "LORA") {
    fail("{} '{}': peft_type {}; accepted: LORA", what, dir, config.value("peft_type", nlohmann::json()).dump());
  }
  const LoraSettings& lora = model.finetune().lora;
  const auto r = config.value("r", nlohmann::json());
  const auto alpha = config.value("lora_alpha", nlohmann::json());
  if (!r.is_number() || r.get<double>() != static_cast<double>(lora.r) || !alpha.is_number() ||
      std::abs(alpha.get<double>() - lora.alpha) > 1e-12) {
    fail("{} '{}': the adapter has r={} and lora_alpha={}, --finetune says r={} and alpha={}; accepted: the "
         "adapter's own (--finetune lora:r={},alpha={},...)",
         what, dir, r.dump(), alpha.dump(), lora.r, lora.alpha, r.dump(), alpha.dump());
  }
  if (config.value("use_dora", false) || config.value("use_rslora", false)) {
    fail("{} '{}': a DoRA or rsLoRA adapter; accepted: plain LoRA", what, dir);
  }
  const std::string file = (root / "adapter_model.safetensors").string();
  const SafetensorsFile f = SafetensorsFile::open(file, what);
  std::map<std::string, at::Tensor> ours = peft_tensors(model);
  // peft names a tensor with its adapter's name in some versions ("….lora_A.default.weight").
  auto ours_of = [](std::string name) {
    const std::string named = ".default.weight";
    if (name.size() > named.size() && name.compare(name.size() - named.size(), named.size(), named) == 0) {
      name = name.substr(0, name.size() - named.size()) + ".weight";
    }
    return name;
  };
  std::set<std::string> seen;
  for (const SafetensorsEntry& e : f.entries()) {
    const auto it = ours.find(ours_of(e.name));
    if (it == ours.end()) {
      fail("{} '{}': unexpected tensor '{}': this model has no such adapter (an adapter for another base, or other "
           "targets than --finetune's {}?)",
           what, file, e.name, model.finetune().name());
    }
    if (at::IntArrayRef(e.shape) != it->second.sizes()) {
      fail("{} '{}': tensor '{}' has shape {}, this model's adapter needs {} (an adapter for another base?)", what,
           file, e.name, fmt::format("{}", fmt::join(e.shape, "×")),
           fmt::format("{}", fmt::join(it->second.sizes(), "×")));
    }
    seen.insert(it->first);
  }
  for (const auto& [name, t] : ours) {
    if (!seen.count(name)) {
      fail("{} '{}': missing tensor '{}' (an adapter of other targets than --finetune's {}?)", what, file, name,
           model.finetune().name());
    }
  }
  const c10::NoGradGuard no_grad;
  for (const SafetensorsEntry& e : f.entries()) ours.at(ours_of(e.name)).copy_(f.load(e.name));
}

}  // namespace headroom
