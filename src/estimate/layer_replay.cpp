#include "estimate/layer_replay.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "config/precision.h"
#include "estimate/meta_models.h"
#include "util/error.h"

namespace headroom::replay {
namespace {

using sim::AttentionShape;
using sim::Category;
using sim::Emit;
using sim::Param;
using sim::Ref;
using sim::Tensor;

constexpr int64_t kCpuRngStateBytes = 5056;  // at::CPUGeneratorImpl state as a byte tensor
constexpr int64_t kCudaRngStateBytes = 16;   // Philox seed and offset

bool is_mixed(Precision p) { return p == Precision::bf16_mixed || p == Precision::fp16_mixed; }

}  // namespace

LayerReplay::LayerReplay(const ModelConfig& c, const TrainSpec& s)
    : sim::Ops(is_mixed(s.precision)),
      c_(c),
      s_(s),
      ew_(static_cast<int>(c10::elementSize(compute_dtype(s.precision)))) {
  const std::string w = fmt::format("{} B each", ew_);
  if (s.pipeline.stages > 1) {
    const std::vector<LayerRange> ranges = pipeline_stages(c, s.pipeline);
    const auto k = static_cast<size_t>(s.stage);
    stage_ = {ranges.at(k).first, ranges.at(k).end, k == 0, k + 1 == ranges.size(), {}};
  }
  // Tensor parallel: the last rank's share, whose vocabulary rows are the most (floor(r·V / T)).
  if (s.tensor_parallel > 1) {
    stage_.tensor.rank = s.tensor_parallel - 1;
    stage_.tensor.ranks = s.tensor_parallel;
    stage_.tensor.sequence = s.sequence_parallel;
  }
  heads_ = stage_.tensor.heads(c.num_heads).size;
  kv_heads_ = stage_.tensor.whole() ? c.num_kv_heads : stage_.tensor.kv_heads(c).size;
  weights_ = mem_.label("weights", Category::weights, "parameters × " + w);
  grads_ = mem_.label("gradients", Category::gradients, "parameters × " + w + ", filled as backward reaches them");
}

void LayerReplay::construct_model() {
  // Shapes from the trainer's own model class on the meta device: nothing allocated.
  shapes_ = meta_model(c_, compute_dtype(s_.precision), s_.finetune, s_.base_weights, stage_);
  for (const auto& np : shapes_->parameters()) add_parameter(np);
  // A tied head is the embedding used a second time: two gradients arrive for it per backward (a
  // pipeline's first and last stages each use their own copy once).
  if (c_.tie_word_embeddings && stage_.embeddings && stage_.head && params_.at("embed_tokens.weight").t.slot) {
    params_.at("embed_tokens.weight").t.slot->uses = 2;
  }
  replay_initialisation();
}

void LayerReplay::add_parameter(const NamedTensor& np) {
  const std::string w = fmt::format("{} B each", ew_);
  if (params_.count(np.name) != 0) return;  // a tied head repeats the embedding
  Param prm;
  prm.rows = np.tensor.size(0);
  prm.cols = np.tensor.dim() == 2 ? np.tensor.size(1) : 0;
  prm.t.numel = np.tensor.numel();
  prm.t.elem = static_cast<int>(np.tensor.element_size());  // ew_, but an NF4 weight's codes and absmax
  // A mixture of experts' weights and gradients are shown apart from the dense ones, frozen
  // weights (--finetune) apart from trained ones, and LoRA's adapters apart from both.
  const bool expert = np.name.find(".mlp.experts.") != std::string::npos;
  const bool adapter = is_lora_parameter(np.name);
  const bool trains = np.tensor.requires_grad();
  if (expert && expert_weights_ < 0) {
    expert_weights_ = mem_.label("expert weights", Category::weights, "the experts' parameters × " + w);
    expert_grads_ = mem_.label("expert gradients", Category::gradients, "the experts' parameters × " + w);
  }
  if (!trains && !expert && frozen_weights_ < 0) {
    frozen_weights_ = mem_.label("frozen weights", Category::weights,
                                 "parameters without gradients or optimizer state (--finetune) × " + w);
  }
  if (adapter && adapter_weights_ < 0) {
    const std::string r = std::to_string(s_.finetune.lora.r);
    adapter_weights_ =
        mem_.label("LoRA adapters", Category::weights, "r·(in + out) per adapted projection, r = " + r + ", × " + w);
    adapter_grads_ = mem_.label("LoRA gradients", Category::gradients, "the adapters' parameters × " + w);
  }
  int weight_label = expert ? expert_weights_ : adapter ? adapter_weights_ : trains ? weights_ : frozen_weights_;
  if (is_nf4_part(np.name)) {
    weight_label = mem_.label("NF4 base weights", Category::weights,
                              "--base-weights nf4: every projection in 4 bits (n/2 B) and a float32 absmax "
                              "per 64 values");
  }
  // full: the parameter holds nothing between uses; the rank's slice is its weight (the gate's).
  if (!gate_) prm.t.buf = mem_.allocate(prm.t.bytes(), weight_label);
  if (trains) {
    prm.t.slot = std::make_shared<sim::GradSlot>();
    prm.t.slot->numel = prm.t.numel;
    prm.t.slot->elem = ew_;
    prm.t.slot->param_label = expert ? expert_grads_ : adapter ? adapter_grads_ : grads_;
  }
  params_.emplace(np.name, prm);
  order_.push_back(np.name);
}

void LayerReplay::replay_initialisation() {
  // CausalLM initialises each parameter in a float32 copy, one at a time, in registration order:
  // nothing at the peak, but a caching allocator keeps the largest copy's segment.
  const int init = mem_.label("initialisation copies", Category::temporaries, "one float32 parameter at a time");
  const bool loaded = !s_.loaded_tensors.empty();
  const auto built = static_cast<int64_t>(c10::elementSize(parameter_dtype(s_.precision)));  // the trainer's model
  // A pipeline stage draws every parameter of the model, in its order, and keeps its own.
  const std::shared_ptr<const CausalLM> whole =
      stage_.whole(c_.num_layers) ? shapes_ : meta_model(c_, compute_dtype(s_.precision), s_.finetune, s_.base_weights);
  for (const NamedTensor& drawn : whole->parameters()) {
    const std::string& name = drawn.name;
    const int64_t numel = drawn.tensor.numel();
    const bool adapter = is_lora_parameter(name);
    if (loaded && !adapter) continue;
    if (is_nf4_part(name)) {
      // An NF4 weight is drawn dense, then quantised without further copies; its absmax draws nothing.
      const std::string weight = nf4_weight_of_codes(name);
      if (!weight.empty()) Ref copy = mem_.allocate(shapes_->nf4_weight(weight)->numel() * 4, init);
      continue;
    }
    const auto held = params_.find(name);
    const bool whole = held != params_.end() && held->second.t.numel == numel;
    // Full sharding: the parameter holds memory (in the dtype it is built in) while it takes its
    // draw and its slice is kept, then lets it go.
    auto keep = [&] {
      Ref restored = mem_.allocate(held->second.t.numel * built, init);
      gate_->keep_slice(name);
    };
    // A float32 parameter held whole on the cpu is drawn in place; any other in a float32 draw
    // (tensor parallel: the share cut from it, a copy) copied in.
    if (whole && !s_.cuda && built == 4) {
      if (gate_) keep();
      continue;
    }
    Ref copy = mem_.allocate(numel * 4, init);
    if (held != params_.end() && !whole) Ref cut = mem_.allocate(held->second.t.numel * 4, init);
    if (gate_ && held != params_.end()) keep();
  }
  // --weights: then the checkpoint's tensors, read one at a time in their file's dtype.
  const int read = mem_.label("checkpoint tensors", Category::temporaries, "--weights: one tensor at a time, as stored");
  for (const int64_t bytes : s_.loaded_tensors) Ref tensor = mem_.allocate(bytes, read);
}

const Param& LayerReplay::p(const std::string& name) const {
  auto it = params_.find(name);
  if (it == params_.end()) fail("estimator: the model has no parameter '{}'", name);
  return it->second;
}

const Param* LayerReplay::maybe(const std::string& name) const {
  auto it = params_.find(name);
  return it == params_.end() ? nullptr : &it->second;
}

Tensor LayerReplay::project(const Tensor& x, const std::string& weight, const Param* bias, int label) {
  const Nf4Weight* nf4 = shapes_->nf4_weight(weight);
  Tensor y = nf4 ? nf4_linear(x, nf4->sizes[0], nf4->sizes[1], mixed_ ? 2 : ew_, bias, label)
                 : linear(x, p(weight), bias, label);
  const Param* a = maybe(lora_a_name(weight));
  if (!a) return y;
  // lora_project(): y + linear(linear(dropout(x), A), B) · scale, each a new tensor.
  const int lbl = act("LoRA activations",
                      "per adapter: its dropout mask (when set), x·Aᵀ (B·T·r), x·Aᵀ·Bᵀ and its scaled copy (B·T·out)");
  const LoraSettings& lora = s_.finetune.lora;
  Tensor in = dropout(x, lora.dropout, lbl);
  Tensor h = linear(in, *a, nullptr, lbl);
  in = Tensor{};
  Tensor u = linear(h, p(lora_b_name(weight)), nullptr, lbl);
  h = Tensor{};
  return add(y, scale(u, lbl), label);
}

Tensor LayerReplay::attention_block(int64_t layer, const Tensor& input, const Rope& rope) {
  const std::string pre = fmt::format("layers.{}.attn.", layer);
  const Tensor x = enter_share(input);
  const int64_t tokens = x.numel / c_.hidden_size;
  const AttentionShape shape{tokens / s_.seq, s_.seq, heads_, kv_heads_, c_.head_dim};
  const int64_t qw = heads_ * c_.head_dim, kw = kv_heads_ * c_.head_dim;
  const int qkv_lbl =
      act("attention q, k, v", "queries, keys and values (after rotary), B·T·(heads + 2·kv_heads)·head_dim");
  Tensor q, k, v;
  if (c_.fused_qkv) {
    Tensor qkv = project(x, pre + "qkv.weight", maybe(pre + "qkv.bias"), qkv_lbl);
    q = g_->alias(qkv, tokens * qw);
    k = g_->alias(qkv, tokens * kw);
    v = g_->alias(qkv, tokens * kw);
    // split/chunk backward: the three gradients are concatenated into one.
    g_->record({&q, &k, &v}, {},
               [this, qkv = meta(qkv)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(qkv)}; });
  } else {
    q = project(x, pre + "q_proj.weight", maybe(pre + "q_proj.bias"), qkv_lbl);
    k = project(x, pre + "k_proj.weight", maybe(pre + "k_proj.bias"), qkv_lbl);
    v = project(x, pre + "v_proj.weight", maybe(pre + "v_proj.bias"), qkv_lbl);
  }
  if (c_.qk_norm != QkNorm::none) {
    // Per head or over the whole projection, the same kernel: the weight's width differs.
    q = rms_norm(q, p(pre + "q_norm.weight"), c_.norm_plus_one);
    k = rms_norm(k, p(pre + "k_norm.weight"), c_.norm_plus_one);
  }
  const bool rotated = c_.rotated(layer);
  if (rotated) {
    const bool local = c_.windowed(layer) && c_.local_rope_theta.has_value();
    const Tensor& cos = local ? rope.local_cos : rope.cos;
    const Tensor& sin = local ? rope.local_sin : rope.sin;
    q = rotary(q, heads_, c_.head_dim, c_.rotary_dim, cos, sin);
    k = rotary(k, kv_heads_, c_.head_dim, c_.rotary_dim, cos, sin);
  }
  const bool windowed = c_.windowed(layer) && *c_.sliding_window < s_.seq;
  Tensor y;
  if (s_.attention == AttentionPath::math) {
    y = explicit_attention(q, k, v, shape, windowed, c_.attn_dropout);
  } else if (c_.attn_dropout > 0) {
    y = math_fallback_attention(q, k, v, shape, c_.attn_dropout);  // the fused kernel has no dropout on cpu
  } else {
    // A query that is not a transposed view of its projection — partial rotary's cat, a q norm's
    // output — makes the kernel's output contiguous in [B, heads, T, hd], and the merge copy it.
    const bool contiguous_query = (rotated && c_.rotary_dim != c_.head_dim);
    // On cuda in 2 bytes a window is FlashAttention's own (model/attention.cpp): no mask; elsewhere
    // the fused kernel gets it as a seq × seq mask.
    const bool mask = windowed && !(s_.cuda && q.elem == 2 && c_.head_dim % 8 == 0 && c_.head_dim <= 256);
    // Unwindowed, the trainer's per-op checkpointing may keep it (model/op_checkpoint.h).
    y = fused_attention(q, k, v, shape, mask, contiguous_query, /*keepable=*/!windowed);
  }
  q = k = v = Tensor{};
  const int res_lbl = act("residual stream", "block outputs and residual sums, B·T·hidden each");
  Tensor o = project_out(y, pre + "o_proj.weight", maybe(pre + "o_proj.bias"), res_lbl);
  return dropout(o, c_.resid_dropout, res_lbl);
}

Tensor LayerReplay::mlp_block(int64_t layer, const Tensor& input) {
  const std::string pre = fmt::format("layers.{}.mlp.", layer);
  const Tensor x = enter_share(input);
  if (c_.sparse(layer)) {
    const MoeConfig& moe = *c_.moe;
    std::vector<ExpertWeights> experts;
    for (int64_t e = 0; e < moe.experts; ++e) {
      const std::string ep = fmt::format("{}experts.{}.", pre, e);
      experts.push_back({&p(ep + "gate_proj.weight"), &p(ep + "up_proj.weight"), &p(ep + "down_proj.weight")});
    }
    const int64_t rows = x.numel / c_.hidden_size;
    const bool stats = moe.aux_loss && g_->grad_mode() && g_ == &graph_;
    const int aux = mem_.label("router load-balancing loss", Category::loss,
                               "per layer: assignments and probabilities summed per expert, float32 × experts");
    Tensor y = mixture_of_experts(x, p(pre + "router.weight"), experts, moe.top_k, moe.normalise_top_k,
                                  s_.routing.loads(rows, moe.experts, moe.top_k),
                                  c_.activation == Activation::relu, stats, aux);
    return dropout(y, c_.resid_dropout, act("residual stream", "block outputs and residual sums, B·T·hidden each"));
  }
  const int lbl = act("MLP activations", "up/gate projections and activation outputs, B·T·intermediate each");
  const bool relu = c_.activation == Activation::relu;
  Tensor h;
  if (c_.fused_gate_up) {
    Tensor both = project(x, pre + "gate_up_proj.weight", nullptr, lbl);
    const int64_t half = both.numel / 2;
    Tensor gate = g_->alias(both, half), up = g_->alias(both, half);
    // chunk's backward: the two gradients concatenated into one.
    g_->record({&gate, &up}, {},
               [this, both = meta(both)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(both)}; });
    h = mul(activation(gate, relu), up, lbl);
  } else if (c_.gated_mlp) {
    Tensor gate = activation(project(x, pre + "gate_proj.weight", maybe(pre + "gate_proj.bias"), lbl), relu);
    Tensor up = project(x, pre + "up_proj.weight", maybe(pre + "up_proj.bias"), lbl);
    h = mul(gate, up, lbl);
  } else {
    h = activation(project(x, pre + "up_proj.weight", maybe(pre + "up_proj.bias"), lbl), relu);
  }
  const int res_lbl = act("residual stream", "block outputs and residual sums, B·T·hidden each");
  Tensor d = project_out(h, pre + "down_proj.weight", maybe(pre + "down_proj.bias"), res_lbl);
  return dropout(d, c_.resid_dropout, res_lbl);
}

Tensor LayerReplay::checkpointed(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x,
                                 std::shared_ptr<sim::KeptOps> kept) {
  if (!x.requires_grad() || !g_->grad_mode()) return fn(x);
  const int64_t rng_bytes = s_.cuda ? kCudaRngStateBytes : kCpuRngStateBytes;
  const int lbl = act("checkpoint inputs", "each checkpointed block keeps its input and the RNG state");
  Ref rng = mem_.allocate(rng_bytes, lbl);
  g_->set_grad_mode(false);
  kept_ = kept.get();
  Tensor y = fn(x);
  kept_ = nullptr;
  g_->set_grad_mode(true);
  y.slot = std::make_shared<sim::GradSlot>();
  y.slot->numel = y.numel;
  y.slot->elem = y.elem;
  // The RNG state (and per-op checkpointing's kept outputs) are the node's own data, not saved
  // tensors (nothing offloads them).
  g_->record({&y}, {x.buf}, [this, fn, x = meta(x), rng, rng_bytes, kept](const std::vector<Ref>& in) {
    // Recompute under grad mode (and a fresh autocast cache), then backpropagate through it.
    // The generator state to put back afterwards, and the saved one being replayed.
    Ref restore = mem_.allocate(rng_bytes, tmp_), replayed = mem_.allocate(rng_bytes, tmp_);
    sim::Graph inner(mem_);
    sim::Graph* outer = g_;
    std::map<const Param*, Tensor> cache;
    auto* outer_cache = cache_;
    g_ = &inner;
    cache_ = &cache;
    if (kept) {
      kept->recompute = true;
      kept->matmuls = 0;
    }
    kept_ = kept.get();
    Tensor input = x;
    input.slot = std::make_shared<sim::GradSlot>();
    input.slot->numel = x.numel;
    input.slot->elem = x.elem;
    Tensor out = fn(view(input));
    kept_ = nullptr;
    inner.backward(out, in[0]);
    out = Tensor{};
    cache.clear();
    g_ = outer;
    cache_ = outer_cache;
    Ref grad = input.slot->grad;
    return std::vector<Emit>{Emit{x.slot, grad}};
  });
  return y;
}

Tensor LayerReplay::op_checkpointed(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x) {
  auto kept = std::make_shared<sim::KeptOps>();
  kept->cuda = s_.cuda;
  return checkpointed(fn, x, std::move(kept));
}

Tensor LayerReplay::block(int64_t layer, const Tensor& x, const Rope& rope, bool selective) {
  const std::string pre = fmt::format("layers.{}.", layer);
  const int res_lbl = act("residual stream", "block outputs and residual sums, B·T·hidden each");
  auto attend = [&](const Tensor& normed) {
    if (!selective || !g_->grad_mode()) return attention_block(layer, normed, rope);
    return checkpointed([this, layer, rope](const Tensor& h) { return attention_block(layer, h, rope); }, normed);
  };
  auto pre_norm = [&](const char* name, const Tensor& in) {
    return norm(in, p(pre + name + ".weight"), maybe(pre + name + ".bias"));
  };
  auto out_norm = [&](const char* name, const Tensor& in) { return norm(in, p(pre + name + ".weight"), nullptr); };
  if (c_.parallel_residual) {
    Tensor with_attn = add(x, attend(pre_norm("input_norm", x)), res_lbl);
    Tensor m = mlp_block(layer, pre_norm("post_attention_norm", x));
    return add(with_attn, m, res_lbl);
  }
  switch (c_.norm_placement) {
    case NormPlacement::post: {
      Tensor h = add(x, out_norm("attention_out_norm", attend(x)), res_lbl);
      return add(h, out_norm("mlp_out_norm", mlp_block(layer, h)), res_lbl);
    }
    case NormPlacement::sandwich: {
      Tensor h = add(x, out_norm("attention_out_norm", attend(pre_norm("input_norm", x))), res_lbl);
      return add(h, out_norm("mlp_out_norm", mlp_block(layer, pre_norm("post_attention_norm", h))), res_lbl);
    }
    case NormPlacement::pre: break;
  }
  Tensor h = add(x, attend(pre_norm("input_norm", x)), res_lbl);
  return add(h, mlp_block(layer, pre_norm("post_attention_norm", h)), res_lbl);
}

Tensor LayerReplay::gate_backward(const Tensor& x, int unit) {
  if (!x.requires_grad() || !g_->grad_mode()) return x;
  // An identity whose backward gathers the layer first; its output a view of x.
  Tensor y = g_->alias(x, x.numel);
  g_->record({&y}, {}, [this, unit, x = meta(x)](const std::vector<Ref>& in) {
    gate_->gather(unit);
    return std::vector<Emit>{pass_to(x, in[0])};
  });
  return y;
}

Tensor LayerReplay::forward(int64_t rows, const Tensor* input) {
  Tensor x = trunk(rows, input);
  const int logits_lbl = mem_.label("logits", Category::logits, "B·T·vocab in the matmul dtype");
  Tensor logits = linear(enter_share(x), head(), nullptr, logits_lbl);
  if (gate_) gate_->forward_done(0, g_->grad_mode());
  return logits;
}

const sim::Param& LayerReplay::head() {
  return c_.tie_word_embeddings ? p("embed_tokens.weight") : p("lm_head.weight");
}

Tensor LayerReplay::trunk(int64_t rows, const Tensor* input) {
  const int64_t t = s_.seq, tokens = rows * t, h = c_.hidden_size;
  const int res_lbl = act("residual stream", "block outputs and residual sums, B·T·hidden each");
  Tensor x;
  if (stage_.embeddings) {
    const Param& embed = p("embed_tokens.weight");
    if (gate_) gate_->gather(0);
    x = stage_.tensor.whole() ? embedding(embed, tokens, ew_, res_lbl) : parallel_embedding(embed, tokens, ew_, res_lbl);
    if (stage_.tensor.splits_sequence()) x = scatter_sequence(x);
    if (c_.embed_scale != 1.0) x = scale(x, res_lbl);
    if (c_.learned_positions) {
      const Param& pos = p("embed_positions.weight");
      // Sequence parallel: the positions of this rank's part of the tokens (arange % seq), one per token.
      const int64_t positions = stage_.tensor.splits_sequence() ? tokens / stage_.tensor.ranks : t;
      Ref arange = mem_.allocate(positions * 8, tmp_);
      if (stage_.tensor.splits_sequence()) arange = mem_.allocate(positions * 8, tmp_);
      Tensor pe = make(positions * h, ew_, tmp_, pos.t.requires_grad());
      g_->record({&pe}, {}, [this, &pos](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(pos.t)}; });
      x = add(x, pe, res_lbl);
    }
    x = dropout(x, c_.embd_dropout, res_lbl);
  } else {
    x = *input;
  }
  Rope rope;
  if (!c_.learned_positions) {
    const int64_t rd = c_.rotary_dim;
    const int lbl = act("rotary tables", "cos and sin, seq × rotary_dim (and the windowed layers' own)");
    auto tables = [&](Tensor& cos, Tensor& sin) {
      Ref inv = mem_.allocate(rd / 2 * 4, tmp_), pos = mem_.allocate(t * 4, tmp_);
      Ref freqs = mem_.allocate(t * rd / 2 * 4, tmp_), emb = mem_.allocate(t * rd * 4, tmp_);
      cos = make(t * rd, 4, lbl, false);
      sin = make(t * rd, 4, lbl, false);
    };
    tables(rope.cos, rope.sin);
    if (c_.local_rope_theta) tables(rope.local_cos, rope.local_sin);
  }
  sim::SavedOffload offload;
  const bool offloading = offloads_activations(s_.offload) && g_->grad_mode();
  if (offloading) {
    offload.host_label = act("offloaded activations", "--offload activations: the storages each layer saves, in host memory");
    offload.restored = act("restored activations",
                           "--offload activations: the saved storages of the layer backward is in, and of the "
                           "one below it (prefetched), back on the device");
    offload.keep = [this](const Ref& r) {
      for (const auto& [name, prm] : params_)
        if (prm.t.buf == r) return true;
      return false;
    };
  }
  const int64_t end = stage_.end < 0 ? c_.num_layers : stage_.end;
  for (int64_t i = stage_.first; i < end; ++i) {
    const int unit = 1 + static_cast<int>(i);
    if (gate_) gate_->gather(unit);
    if (offloading) {
      offload.next_layer();
      g_->set_offload(&offload);
    }
    if (s_.checkpointing.per_op() && g_->grad_mode()) {
      x = op_checkpointed([this, i, rope](const Tensor& in) { return block(i, in, rope, false); }, x);
    } else if (s_.checkpointing.whole_layer(i) && g_->grad_mode()) {
      x = checkpointed([this, i, rope](const Tensor& in) { return block(i, in, rope, false); }, x);
    } else {
      x = block(i, x, rope, s_.checkpointing.attention_only());
    }
    if (offloading) {
      g_->set_offload(nullptr);
    }
    if (gate_) {
      gate_->forward_done(unit, g_->grad_mode());
      x = gate_backward(x, unit);
    }
  }
  if (!stage_.head) return x;
  if (gate_ && !stage_.embeddings) gate_->gather(0);  // a pipeline's last stage: its final norm and head
  return norm(x, p("final_norm.weight"), maybe("final_norm.bias"));
}

}  // namespace headroom::replay
