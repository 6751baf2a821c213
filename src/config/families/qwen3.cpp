// Qwen3 (Qwen3ForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM): Llama's layout without qkv biases,
// with an RMS norm of each query and key head before rotary; the MoE variant replaces the MLP of
// every decoder_sparse_step-th layer not in mlp_only_layers by num_experts experts, num_experts_per_tok
// per token.
#include <fmt/format.h>

#include "config/family_readers.h"

namespace headroom::config_reading {

void read_router_loss(FieldReader& r, MoeConfig& moe, double default_coef) {
  moe.aux_loss = r.boolean_or("output_router_logits", false);
  moe.aux_loss_coef = r.number_or("router_aux_loss_coef", default_coef);
}

void read_qwen3(FieldReader& r, ModelConfig& c, const std::string& origin) {
  read_decoder_core(r, c, origin);
  c.qkv_bias = c.out_bias = r.boolean_or("attention_bias", false);
  c.qk_norm = QkNorm::per_head;
  if (r.boolean_or("use_sliding_window", false) && r.has("sliding_window")) {
    c.sliding_window = r.integer("sliding_window");
    if (!read_layer_types(r, c, origin)) c.window_from_layer = r.integer_or("max_window_layers", 28);
  } else {
    r.has("layer_types");  // without a window every layer is full attention
    r.has("max_window_layers");
  }
  if (c.family != Family::qwen3_moe) return;
  MoeConfig moe;
  // transformers 5 writes num_local_experts for it; earlier configs (the hub's) num_experts.
  if (r.has("num_experts") && r.has("num_local_experts") &&
      r.integer("num_experts") != r.integer("num_local_experts")) {
    fail("{}: num_experts ({}) and num_local_experts ({}) disagree; accepted: one of them (transformers 5 writes "
         "num_local_experts)",
         origin, r.integer("num_experts"), r.integer("num_local_experts"));
  }
  moe.experts = r.has("num_experts") ? r.integer("num_experts") : r.integer_or("num_local_experts", 128);
  moe.top_k = r.integer_or("num_experts_per_tok", 8);
  moe.intermediate_size = r.integer_or("moe_intermediate_size", 768);
  moe.normalise_top_k = r.boolean_or("norm_topk_prob", false);
  moe.sparse_step = r.integer_or("decoder_sparse_step", 1);
  if (r.has("mlp_only_layers")) {
    const json& layers = r.raw("mlp_only_layers");
    if (!layers.is_array()) fail("{}: mlp_only_layers must be a list of layer indices", origin);
    for (const json& l : layers) {
      if (!l.is_number_integer() || l.get<int64_t>() < 0) {
        fail("{}: mlp_only_layers holds {}; accepted: non-negative layer indices", origin, dump_json(l));
      }
      moe.dense_layers.push_back(l.get<int64_t>());
    }
  }
  read_router_loss(r, moe, 0.001);
  c.moe = moe;
}

}  // namespace headroom::config_reading
