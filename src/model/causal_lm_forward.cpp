// CausalLM's forward pass (model/causal_lm.h): the norms, attention, MLP and block of a layer, the
// trunk over the layers (checkpointed, offloaded or plain, as ForwardOptions say) and the head. The
// parameters, adapters and quantised weights they read are made in causal_lm.cpp.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <memory>
#include <optional>

#include "model/activation.h"
#include "model/causal_lm.h"
#include "model/op_checkpoint.h"
#include "util/error.h"

namespace headroom {

at::Tensor CausalLM::norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) const {
  const int64_t n = w.size(0);
  if (config_.norm == NormKind::layer_norm) return at::layer_norm(x, {n}, w, b, config_.norm_eps);
  // Gemma's norm scales by (1 + w): a new vector of the norm's width, then the same kernel.
  return at::rms_norm(x, {n}, config_.norm_plus_one ? w + 1 : w, config_.norm_eps);
}

namespace {

at::Tensor maybe_dropout(const at::Tensor& x, double p, bool training) {
  return (training && p > 0) ? at::dropout(x, p, true) : x;
}

}  // namespace

at::Tensor CausalLM::kv_param(const at::Tensor& p) const {
  const TensorSlice& tp = stage_.tensor;
  if (!p.defined() || !tp.kv_replicated(config_)) return p;
  const int64_t hd = config_.head_dim;
  return replicated_rows_gradient(p, 0, tp.kv_heads(config_).begin * hd, config_.num_kv_heads * hd, tp);
}

at::Tensor CausalLM::project_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                 const LoraAdapter& lora, const Nf4Weight& nf4, const ForwardOptions& o) const {
  const TensorSlice& tp = stage_.tensor;
  if (tp.whole()) return project(x, w, b, lora, nf4, o);
  const at::Tensor partial = op_matmul(x, w);
  const at::Tensor y = tp.splits_sequence() ? scatter_sequence(partial, tp) : leave_parallel(partial, tp);
  return b.defined() ? y + region_param(b) : y;
}

at::Tensor CausalLM::enter_share(const at::Tensor& input) const {
  const TensorSlice& tp = stage_.tensor;
  if (tp.whole()) return input;
  return tp.splits_sequence() ? gather_sequence(input, tp) : enter_parallel(input, tp);
}

at::Tensor CausalLM::region_param(const at::Tensor& p) const {
  return stage_.tensor.splits_sequence() && p.defined() ? shared_gradient(p, stage_.tensor) : p;
}

at::Tensor CausalLM::region_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) const {
  return norm(x, region_param(w), region_param(b));
}

at::Tensor CausalLM::attention(const Layer& l, const at::Tensor& input, const RotaryTables& rope,
                               const ForwardOptions& o) const {
  const ModelConfig& c = config_;
  const TensorSlice& tp = stage_.tensor;
  // Tensor parallel: this rank's heads, the input's gradient summed over the ranks.
  const at::Tensor x = enter_share(input);
  const int64_t b = x.size(0), t = x.size(1);
  const int64_t hd = c.head_dim;
  const int64_t q_dim = heads_ * hd, kv_dim = kv_heads_ * hd;
  // Per-head q/k norms are shared by every rank's heads: their gradients summed over the ranks.
  const at::Tensor q_norm_w = tp.whole() || !l.q_norm_w.defined() ? l.q_norm_w : shared_gradient(l.q_norm_w, tp);
  const at::Tensor k_norm_w = tp.whole() || !l.k_norm_w.defined() ? l.k_norm_w : shared_gradient(l.k_norm_w, tp);
  at::Tensor q, k, v;
  if (c.fused_qkv && c.family == Family::gpt_neox) {
    // gpt_neox interleaves per head: [.., H, 3 * hd].
    auto qkv = project(x, l.qkv_w, l.qkv_b, l.lora_qkv, l.nf4_qkv, o).view({b, t, heads_, 3 * hd});
    auto parts = qkv.chunk(3, -1);
    q = parts[0];
    k = parts[1];
    v = parts[2];
  } else if (c.fused_qkv) {
    auto parts = project(x, l.qkv_w, l.qkv_b, l.lora_qkv, l.nf4_qkv, o).split_with_sizes({q_dim, kv_dim, kv_dim}, -1);
    q = parts[0];
    k = parts[1];
    v = parts[2];
  } else {
    q = project(x, l.q_w, l.q_b, l.lora_q, l.nf4_q, o);
    k = project(x, kv_param(l.k_w), kv_param(l.k_b), l.lora_k, l.nf4_k, o);
    v = project(x, kv_param(l.v_w), kv_param(l.v_b), l.lora_v, l.nf4_v, o);
  }
  if (c.qk_norm == QkNorm::whole) {  // olmo2: over the whole projection, before the heads split
    q = norm(q, q_norm_w, {});
    k = norm(k, k_norm_w, {});
  }
  q = q.view({b, t, heads_, hd});
  k = k.view({b, t, kv_heads_, hd});
  v = v.view({b, t, kv_heads_, hd});
  if (c.qk_norm == QkNorm::per_head) {  // qwen3, gemma3: each head over head_dim
    q = norm(q, q_norm_w, {});
    k = norm(k, k_norm_w, {});
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  if (l.rotary) {
    const Rotary& r = l.local_rope ? local_rotary_ : rotary_;
    const auto& [cos, sin] = l.local_rope ? rope.local : rope.global;
    q = r.apply(q, cos, sin);
    k = r.apply(k, cos, sin);
  }
  auto y = causal_attention(q, k, v, o.attention, o.training ? c.attn_dropout : 0.0, l.window, c.attn_scale);
  y = y.transpose(1, 2).reshape({b, t, q_dim});
  return maybe_dropout(project_out(y, l.o_w, l.o_b, l.lora_o, l.nf4_o, o), c.resid_dropout, o.training);
}

at::Tensor CausalLM::mlp(const Layer& l, const at::Tensor& input, const ForwardOptions& o, RouterStats* stats) const {
  const ModelConfig& c = config_;
  const at::Tensor x = enter_share(input);
  if (!l.experts.empty()) {
    return maybe_dropout(mixture_of_experts(x, l.router_w, l.experts, *c.moe, c.activation, stats), c.resid_dropout,
                         o.training);
  }
  at::Tensor h;
  if (c.fused_gate_up) {
    auto gate_up = project(x, l.gate_up_w, {}, l.lora_gate_up, l.nf4_gate_up, o).chunk(2, -1);
    h = activate(gate_up[0], c.activation) * gate_up[1];
  } else if (c.gated_mlp) {
    // Sequenced, gate first: the operands of * are evaluated in an unspecified order, and per-op
    // checkpointing counts the matmuls in order.
    const at::Tensor gate = activate(project(x, l.gate_w, l.gate_b, l.lora_gate, l.nf4_gate, o), c.activation);
    h = gate * project(x, l.up_w, l.up_b, l.lora_up, l.nf4_up, o);
  } else {
    h = activate(project(x, l.up_w, l.up_b, l.lora_up, l.nf4_up, o), c.activation);
  }
  return maybe_dropout(project_out(h, l.down_w, l.down_b, l.lora_down, l.nf4_down, o), c.resid_dropout, o.training);
}

at::Tensor CausalLM::block(const Layer& l, const at::Tensor& x, const RotaryTables& rope, const ForwardOptions& o,
                           RouterStats* stats) const {
  auto attend = [&](const at::Tensor& normed) {
    if (!o.checkpoint.attention_only() || !c10::GradMode::is_enabled()) return attention(l, normed, rope, o);
    const Layer* layer = &l;
    return checkpointed([this, layer, rope, o](const at::Tensor& h) { return attention(*layer, h, rope, o); },
                        normed);
  };
  if (config_.parallel_residual) {
    // Sequenced: the operands of + are evaluated in an unspecified order, and the order decides
    // which branch backward visits first (and so what memory is live when).
    at::Tensor with_attention = x + attend(region_norm(x, l.norm1_w, l.norm1_b));
    return with_attention + mlp(l, region_norm(x, l.norm2_w, l.norm2_b), o, stats);
  }
  switch (config_.norm_placement) {
    case NormPlacement::pre: {
      auto h = x + attend(region_norm(x, l.norm1_w, l.norm1_b));
      return h + mlp(l, region_norm(h, l.norm2_w, l.norm2_b), o, stats);
    }
    case NormPlacement::post: {
      auto h = x + region_norm(attend(x), l.attn_out_norm_w, {});
      return h + region_norm(mlp(l, h, o, stats), l.mlp_out_norm_w, {});
    }
    case NormPlacement::sandwich: {
      auto h = x + region_norm(attend(region_norm(x, l.norm1_w, l.norm1_b)), l.attn_out_norm_w, {});
      return h + region_norm(mlp(l, region_norm(h, l.norm2_w, l.norm2_b), o, stats), l.mlp_out_norm_w, {});
    }
  }
  return x;
}

at::Tensor CausalLM::forward(const at::Tensor& input_ids, const ForwardOptions& o, RouterOutput* router) const {
  TORCH_CHECK(stage_.head, "forward: this pipeline stage has no head; hidden_states gives its output");
  Trunk trunk = run_trunk(input_ids, o, router);
  at::Tensor logits = head(trunk.hidden);
  if (o.gate) o.gate->forward_done(0);
  report_router(trunk, router);
  return logits;
}

at::Tensor CausalLM::head(const at::Tensor& hidden) const {
  return at::linear(enter_share(hidden), head_);
}

at::Tensor CausalLM::hidden_states(const at::Tensor& input_ids, const ForwardOptions& o, RouterOutput* router) const {
  TORCH_CHECK(o.gate == nullptr || !stage_.head, "hidden_states: not with a parameter gate on a model with its head");
  Trunk trunk = run_trunk(input_ids, o, router);
  // A first pipeline stage is done with its embeddings (kept for backward while it records).
  if (o.gate && stage_.embeddings) o.gate->forward_done(0);
  report_router(trunk, router);
  return trunk.hidden;
}

void CausalLM::report_router(const Trunk& trunk, RouterOutput* router) const {
  if (!router) return;
  router->skew = trunk.stats->skew;
  if (trunk.stats->balance && trunk.stats->rows > 0) router->loss = load_balancing_loss(*trunk.stats, *config_.moe);
}

CausalLM::Trunk CausalLM::run_trunk(const at::Tensor& input, const ForwardOptions& o, RouterOutput* router) const {
  if (stage_.embeddings) {
    TORCH_CHECK(input.dim() == 2, "input_ids must be [batch, seq], got ", input.sizes());
  } else {
    TORCH_CHECK(input.dim() == 3, "a later pipeline stage's input must be [batch, seq, hidden], got ", input.sizes());
  }
  // Sequence parallel: a later pipeline stage receives this rank's part of the tokens.
  const TensorSlice& tp = stage_.tensor;
  const int64_t t = stage_.embeddings || !tp.splits_sequence() ? input.size(1) : input.size(1) * tp.ranks;
  if (t > config_.max_positions) {
    fail("sequence length {} exceeds the model's max_position_embeddings {}", t, config_.max_positions);
  }
  // The load-balancing loss: its statistics gather layer by layer while gradients are recorded.
  const bool balance = router && config_.moe && config_.moe->aux_loss && c10::GradMode::is_enabled();
  bool whole_sparse_layer = false;
  for (int64_t i = 0; i < config_.num_layers; ++i) whole_sparse_layer |= config_.sparse(i) && o.checkpoint.whole_layer(i);
  if (balance && whole_sparse_layer) {
    fail("output_router_logits (the router's load-balancing loss) with activation checkpointing is not supported; "
         "accepted: --checkpointing none, or --set output_router_logits=false");
  }
  // Shared: a checkpointed layer's recompute (in backward, after this returns) reports into it too.
  const auto stats = std::make_shared<RouterStats>();
  stats->balance = balance;
  RouterStats* collect = router && config_.moe ? stats.get() : nullptr;
  ParameterGate* gate = o.gate;
  at::Tensor x = input;
  if (stage_.embeddings) {
    if (gate) gate->gather(0);
    x = stage_.tensor.whole() ? at::embedding(embed_, input)
                              : parallel_embedding(embed_, input, stage_.tensor, config_.vocab_size);
    if (config_.embed_scale != 1.0) {
      // Gemma: sqrt(hidden_size) in the weights' dtype, as Hugging Face rounds it.
      x = x * at::scalar_tensor(config_.embed_scale, at::TensorOptions().dtype(embed_.scalar_type())).item<double>();
    }
    if (config_.learned_positions) {
      x = x + (tp.splits_sequence()
                   ? at::embedding(region_param(pos_embed_), sequence_positions(input.size(0), t, tp, input.options()))
                   : at::embedding(pos_embed_, at::arange(t, input.options())));
    }
    x = maybe_dropout(x, config_.embd_dropout, o.training);
  }
  RotaryTables rope;
  if (!config_.learned_positions) {
    rope.global = rotary_.tables(t, x.device());
    if (config_.local_rope_theta) rope.local = local_rotary_.tables(t, x.device());
  }
  if (o.offload) o.offload->start_forward();
  for (auto i = static_cast<size_t>(stage_.first); i < static_cast<size_t>(stage_.end); ++i) {
    const Layer* l = &layers_[i];
    const int unit = 1 + static_cast<int>(i);
    if (gate) gate->gather(unit);
    std::optional<ActivationOffload::LayerScope> offloaded;
    if (o.offload && c10::GradMode::is_enabled()) offloaded.emplace(*o.offload);
    if (o.checkpoint.per_op() && c10::GradMode::is_enabled()) {
      ForwardOptions inner = o;
      inner.checkpoint = {};
      x = op_checkpointed([this, l, rope, inner](const at::Tensor& h) { return block(*l, h, rope, inner, nullptr); },
                          x);
    } else if (o.checkpoint.whole_layer(static_cast<int64_t>(i)) && c10::GradMode::is_enabled()) {
      ForwardOptions inner = o;
      inner.checkpoint = {};  // nothing nested inside a checkpointed layer
      inner.offload = nullptr;  // its recompute runs in backward
      // Only the routing's skew from a checkpointed layer (its load-balancing loss is refused above).
      std::shared_ptr<RouterStats> skew = collect ? stats : nullptr;
      x = checkpointed(
          [this, l, rope, inner, skew](const at::Tensor& h) { return block(*l, h, rope, inner, skew.get()); }, x);
    } else {
      x = block(*l, x, rope, o, collect);
    }
    if (gate) {
      gate->forward_done(unit);
      x = gate_backward(x, gate, unit);  // backward finds the layer's parameters in place again
    }
  }
  if (!stage_.head) return {x, stats};
  // A pipeline's last stage: the final norm and the head are its unit 0.
  if (gate && !stage_.embeddings) gate->gather(0);
  return {region_norm(x, final_norm_w_, final_norm_b_), stats};
}

}  // namespace headroom
