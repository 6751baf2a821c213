// peft's LoRA adapter directory, written and read: adapter_config.json (peft_type LORA, r,
// lora_alpha, lora_dropout, target_modules, ...) and adapter_model.safetensors, whose tensors are
// named as peft saves them: "base_model.model." + the adapted module's Hugging Face path +
// ".lora_A.weight" / ".lora_B.weight". peft's PeftModel.from_pretrained loads what
// save_peft_adapter writes; load_peft_adapter reads peft's own (an adapter of another base, rank
// or target set is an Error naming the first tensor or setting that differs, and changes nothing).
#pragma once

#include <string>

#include "model/causal_lm.h"

namespace headroom {

// Writes `model`'s LoRA adapters into `dir` (created if need be), each file atomically; `base`
// names the base checkpoint (base_model_name_or_path).
void save_peft_adapter(const std::string& dir, const CausalLM& model, const std::string& base,
                       const std::string& what = "--save-weights");

// Loads the adapter in `dir` into `model`'s LoRA adapters.
void load_peft_adapter(const std::string& dir, CausalLM& model, const std::string& what = "--adapter");

}  // namespace headroom
