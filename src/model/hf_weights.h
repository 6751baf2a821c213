// Hugging Face checkpoints into headroom's models: a directory holding model.safetensors, or the
// shards that model.safetensors.index.json names, mapped family by family onto CausalLM's
// parameters (names, gpt2's transposed Conv1D weights, experts stored per expert or as 3-D tensors,
// Gemma 3's and OLMo-2's norms, a multimodal Gemma 3's language model), converted to the model's
// dtype. Buffers older checkpoints carry (rotary inv_freq, causal masks) are skipped; a tied head
// may be absent or present. The first missing, unexpected or mis-shaped tensor is an Error naming
// it, and the model is left unchanged by a load that fails.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "config/model_config.h"
#include "model/causal_lm.h"

namespace headroom {

// headroom's names and tensors for one tensor of a Hugging Face checkpoint of `family`: usually one,
// several for a 3-D expert tensor, none for a buffer to skip. Error for a name it does not know.
std::vector<std::pair<std::string, at::Tensor>> headroom_tensors(const std::string& hf_name, const at::Tensor& t,
                                                                 const ModelConfig& config);

// The bytes of each tensor load_hf_weights reads from `dir` for a model of `config`, in order (each
// is read into memory of its own, then copied into its parameter): for the estimator.
std::vector<int64_t> hf_load_sequence(const std::string& dir, const ModelConfig& config,
                                      const std::string& what = "--weights");

// The Hugging Face name of one of CausalLM's parameters (its model's save_pretrained name).
std::string hf_parameter_name(const std::string& ours, const ModelConfig& config);

// Loads `dir` into `model`'s parameters (LoRA adapters excepted: model/peft_adapter.h); `what`
// names the directory's origin in errors (a flag).
// Names and shapes are checked from the files' headers before any parameter changes; then the
// tensors are read one at a time.
void load_hf_weights(const std::string& dir, CausalLM& model, const std::string& what = "--weights");

// The model's parameters under the names and layouts transformers' save_pretrained writes for its
// family (the hub's: Mixtral's block_sparse_moe w1/w3/w2, Qwen3-MoE's experts one by one, gpt2's
// Conv1D weights transposed), without a tied head and without LoRA adapters, which `merge_lora`
// adds into their weights (W + alpha/r · B A).
std::vector<std::pair<std::string, at::Tensor>> hf_checkpoint_tensors(const CausalLM& model, bool merge_lora = false);

// Error when a checkpoint of `config` cannot be written (a multimodal gemma3's).
void check_hf_savable(const ModelConfig& config, const std::string& what = "--save-weights");

// Writes `model` into `dir` (created if need be) as a Hugging Face checkpoint: model.safetensors in
// the weights' dtype and config.json (the model's config, its dtype that one), each atomically.
void save_hf_weights(const std::string& dir, const CausalLM& model, bool merge_lora = false,
                     const std::string& what = "--save-weights");

}  // namespace headroom
