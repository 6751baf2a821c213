// LoRA on CausalLM's projections (config/finetune.h): which modules a LoRA setting adapts, the
// adapter's parameters, and the adapted projection's forward, as peft's LoRA Linear computes it:
// base(x) + B(A(dropout(x))) · alpha / r.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "config/finetune.h"
#include "config/model_config.h"

namespace headroom {

// One adapter: A [r, in] and B [out, r]; undefined when the projection is not adapted.
struct LoraAdapter {
  at::Tensor a, b;
  bool defined() const { return a.defined(); }
};

// A projection module of layer `layer` that LoRA may adapt: its weight's name in CausalLM, its
// shape, and the roles (config/finetune.h's Projection) it serves — several for a fused module.
struct AdaptableModule {
  std::string weight;  // "layers.3.attn.q_proj.weight"
  int64_t out = 0, in = 0;
  std::vector<Projection> roles;
};

// The modules of layer `layer` that may be adapted, in CausalLM's order. A mixture of experts'
// experts and router are not (peft's target modules are Linear layers; transformers holds experts
// as 3-D tensors).
std::vector<AdaptableModule> adaptable_modules(const ModelConfig& c, int64_t layer);

// The adapter parameters' names for a module's weight name: "….q_proj.lora_A.weight", "….lora_B.weight".
std::string lora_a_name(const std::string& weight);
std::string lora_b_name(const std::string& weight);

// Whether a parameter's name is an adapter's (lora_A or lora_B).
bool is_lora_parameter(const std::string& name);

// The trainable parameters LoRA adds to the whole model: r·(in + out) per adapted module.
int64_t lora_parameters(const ModelConfig& c, const LoraSettings& lora);

// The projection's output `y` (of x) with, when `adapter` is defined, its adapter's added.
at::Tensor lora_project(const at::Tensor& x, const at::Tensor& y, const LoraAdapter& adapter, const LoraSettings& lora,
                        bool training);

}  // namespace headroom
