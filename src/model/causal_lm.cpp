#include "model/causal_lm.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <cmath>

#include "device/storage_adapter.h"
#include "util/error.h"

namespace headroom {

at::Tensor CausalLM::add_param(const std::string& name, std::vector<int64_t> shape) {
  at::Tensor t = at::empty(shape, options_);
  if (release_ && !options_.device().is_meta()) release_storage(t);  // memory again only to be initialised
  params_.push_back({name, t});
  return t;
}

namespace {

// A parameter's initial value as Hugging Face draws it, on the CPU: norm weights one, biases zero,
// the rest normal(0, std_dev), the residual projections normal(0, proj_std).
at::Tensor initial_value(const std::string& name, at::IntArrayRef sizes, double std_dev, double proj_std,
                         const at::Generator& gen) {
  at::Tensor cpu = at::empty(sizes, at::TensorOptions().dtype(at::kFloat));
  const bool is_norm = name.find("norm.") != std::string::npos;
  const bool is_bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  const bool is_residual_proj =
      name.find("o_proj.weight") != std::string::npos || name.find("down_proj.weight") != std::string::npos;
  if (is_norm && !is_bias) cpu.fill_(1.0);
  else if (is_bias) cpu.zero_();
  else cpu.normal_(0.0, is_residual_proj ? proj_std : std_dev, gen);
  return cpu;
}

// Initialise each parameter on the CPU from one generator, in registration order, then copy; with
// `keep`, each parameter holds memory only while it is initialised and kept.
void initialise(std::vector<NamedTensor>& params, const ModelConfig& c, uint64_t seed,
                const CausalLM::KeepParameter& keep) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double std_dev = c.initializer_range;
  const double proj_std = c.family == Family::gpt2 ? std_dev / std::sqrt(2.0 * c.num_layers) : std_dev;
  c10::NoGradGuard no_grad;
  for (auto& [name, t] : params) {
    const at::Tensor cpu = initial_value(name, t.sizes(), std_dev, proj_std, gen);
    if (!keep) {
      t.copy_(cpu);
      continue;
    }
    restore_storage(t);
    t.copy_(cpu);
    keep({name, t});
    release_storage(t);
  }
  for (auto& [name, t] : params) t.requires_grad_(true);
}

}  // namespace

CausalLM::CausalLM(const ModelConfig& config, const at::TensorOptions& options, uint64_t seed,
                   const KeepParameter& keep)
    : config_(config), options_(options), release_(static_cast<bool>(keep)), rotary_(config) {
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size;
  const int64_t q_dim = c.num_heads * c.head_dim;
  const int64_t kv_dim = c.num_kv_heads * c.head_dim;
  const int64_t inter = c.intermediate_size;
  const bool layer_norm = c.norm == NormKind::layer_norm;

  // Allocate on the target device directly; init happens after, on CPU copies.
  embed_ = add_param("embed_tokens.weight", {c.vocab_size, d});
  if (c.learned_positions) pos_embed_ = add_param("embed_positions.weight", {c.max_positions, d});
  layers_.resize(static_cast<size_t>(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    Layer& l = layers_[static_cast<size_t>(i)];
    const std::string p = fmt::format("layers.{}.", i);
    if (i >= c.window_from_layer) l.window = c.sliding_window;
    l.norm1_w = add_param(p + "input_norm.weight", {d});
    if (layer_norm) l.norm1_b = add_param(p + "input_norm.bias", {d});
    if (c.fused_qkv) {
      l.qkv_w = add_param(p + "attn.qkv.weight", {q_dim + 2 * kv_dim, d});
      if (c.qkv_bias) l.qkv_b = add_param(p + "attn.qkv.bias", {q_dim + 2 * kv_dim});
    } else {
      l.q_w = add_param(p + "attn.q_proj.weight", {q_dim, d});
      if (c.qkv_bias) l.q_b = add_param(p + "attn.q_proj.bias", {q_dim});
      l.k_w = add_param(p + "attn.k_proj.weight", {kv_dim, d});
      if (c.qkv_bias) l.k_b = add_param(p + "attn.k_proj.bias", {kv_dim});
      l.v_w = add_param(p + "attn.v_proj.weight", {kv_dim, d});
      if (c.qkv_bias) l.v_b = add_param(p + "attn.v_proj.bias", {kv_dim});
    }
    l.o_w = add_param(p + "attn.o_proj.weight", {d, q_dim});
    if (c.out_bias) l.o_b = add_param(p + "attn.o_proj.bias", {d});
    l.norm2_w = add_param(p + "post_attention_norm.weight", {d});
    if (layer_norm) l.norm2_b = add_param(p + "post_attention_norm.bias", {d});
    if (c.gated_mlp) {
      l.gate_w = add_param(p + "mlp.gate_proj.weight", {inter, d});
      if (c.mlp_bias) l.gate_b = add_param(p + "mlp.gate_proj.bias", {inter});
    }
    l.up_w = add_param(p + "mlp.up_proj.weight", {inter, d});
    if (c.mlp_bias) l.up_b = add_param(p + "mlp.up_proj.bias", {inter});
    l.down_w = add_param(p + "mlp.down_proj.weight", {d, inter});
    if (c.mlp_bias) l.down_b = add_param(p + "mlp.down_proj.bias", {d});
  }
  final_norm_w_ = add_param("final_norm.weight", {d});
  if (layer_norm) final_norm_b_ = add_param("final_norm.bias", {d});
  head_ = c.tie_word_embeddings ? embed_ : add_param("lm_head.weight", {c.vocab_size, d});

  if (options_.device().is_meta()) return;
  initialise(params_, c, seed, keep);
}

std::vector<at::Tensor> CausalLM::parameter_tensors() const {
  std::vector<at::Tensor> out;
  out.reserve(params_.size());
  for (const auto& p : params_) out.push_back(p.tensor);
  return out;
}

std::vector<int> CausalLM::parameter_units() const {
  std::vector<int> units;
  units.reserve(params_.size());
  for (const auto& p : params_) {
    int unit = 0;
    if (p.name.rfind("layers.", 0) == 0) unit = 1 + std::stoi(p.name.substr(7, p.name.find('.', 7) - 7));
    units.push_back(unit);
  }
  return units;
}

int64_t CausalLM::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.tensor.numel();
  return n;
}

at::Tensor CausalLM::norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) const {
  if (config_.norm == NormKind::layer_norm) return at::layer_norm(x, {config_.hidden_size}, w, b, config_.norm_eps);
  return at::rms_norm(x, {config_.hidden_size}, w, config_.norm_eps);
}

namespace {

at::Tensor activate(const at::Tensor& x, Activation a) {
  switch (a) {
    case Activation::gelu: return at::gelu(x);
    case Activation::gelu_tanh: return at::gelu(x, "tanh");
    case Activation::silu: return at::silu(x);
    case Activation::relu: return at::relu(x);
  }
  return x;
}

at::Tensor maybe_dropout(const at::Tensor& x, double p, bool training) {
  return (training && p > 0) ? at::dropout(x, p, true) : x;
}

}  // namespace

at::Tensor CausalLM::attention(const Layer& l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               const ForwardOptions& o) const {
  const ModelConfig& c = config_;
  const int64_t b = x.size(0), t = x.size(1);
  const int64_t hd = c.head_dim;
  at::Tensor q, k, v;
  if (c.fused_qkv && c.family == Family::gpt_neox) {
    // gpt_neox interleaves per head: [.., H, 3 * hd].
    auto qkv = at::linear(x, l.qkv_w, l.qkv_b).view({b, t, c.num_heads, 3 * hd});
    auto parts = qkv.chunk(3, -1);
    q = parts[0].transpose(1, 2);
    k = parts[1].transpose(1, 2);
    v = parts[2].transpose(1, 2);
  } else if (c.fused_qkv) {
    auto parts = at::linear(x, l.qkv_w, l.qkv_b).split(c.hidden_size, -1);
    q = parts[0].view({b, t, c.num_heads, hd}).transpose(1, 2);
    k = parts[1].view({b, t, c.num_kv_heads, hd}).transpose(1, 2);
    v = parts[2].view({b, t, c.num_kv_heads, hd}).transpose(1, 2);
  } else {
    q = at::linear(x, l.q_w, l.q_b).view({b, t, c.num_heads, hd}).transpose(1, 2);
    k = at::linear(x, l.k_w, l.k_b).view({b, t, c.num_kv_heads, hd}).transpose(1, 2);
    v = at::linear(x, l.v_w, l.v_b).view({b, t, c.num_kv_heads, hd}).transpose(1, 2);
  }
  if (!c.learned_positions) {
    q = rotary_.apply(q, cos, sin);
    k = rotary_.apply(k, cos, sin);
  }
  auto y = causal_attention(q, k, v, o.attention, o.training ? c.attn_dropout : 0.0, l.window);
  y = y.transpose(1, 2).reshape({b, t, c.num_heads * hd});
  return maybe_dropout(at::linear(y, l.o_w, l.o_b), c.resid_dropout, o.training);
}

at::Tensor CausalLM::mlp(const Layer& l, const at::Tensor& x, const ForwardOptions& o) const {
  const ModelConfig& c = config_;
  at::Tensor h = c.gated_mlp ? activate(at::linear(x, l.gate_w, l.gate_b), c.activation) * at::linear(x, l.up_w, l.up_b)
                             : activate(at::linear(x, l.up_w, l.up_b), c.activation);
  return maybe_dropout(at::linear(h, l.down_w, l.down_b), c.resid_dropout, o.training);
}

at::Tensor CausalLM::block(const Layer& l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           const ForwardOptions& o) const {
  auto attend = [&](const at::Tensor& normed) {
    if (!o.checkpoint.attention_only() || !c10::GradMode::is_enabled()) return attention(l, normed, cos, sin, o);
    const Layer* layer = &l;
    return checkpointed([this, layer, cos, sin, o](const at::Tensor& h) { return attention(*layer, h, cos, sin, o); },
                        normed);
  };
  if (config_.parallel_residual) {
    // Sequenced: the operands of + are evaluated in an unspecified order, and the order decides
    // which branch backward visits first (and so what memory is live when).
    at::Tensor with_attention = x + attend(norm(x, l.norm1_w, l.norm1_b));
    return with_attention + mlp(l, norm(x, l.norm2_w, l.norm2_b), o);
  }
  auto h = x + attend(norm(x, l.norm1_w, l.norm1_b));
  return h + mlp(l, norm(h, l.norm2_w, l.norm2_b), o);
}

at::Tensor CausalLM::forward(const at::Tensor& input_ids, const ForwardOptions& o) const {
  TORCH_CHECK(input_ids.dim() == 2, "input_ids must be [batch, seq], got ", input_ids.sizes());
  const int64_t t = input_ids.size(1);
  if (t > config_.max_positions) {
    fail("sequence length {} exceeds the model's max_position_embeddings {}", t, config_.max_positions);
  }
  ParameterGate* gate = o.gate;
  if (gate) gate->gather(0);
  at::Tensor x = at::embedding(embed_, input_ids);
  if (config_.learned_positions) {
    x = x + at::embedding(pos_embed_, at::arange(t, input_ids.options()));
  }
  x = maybe_dropout(x, config_.embd_dropout, o.training);
  at::Tensor cos, sin;
  if (!config_.learned_positions) std::tie(cos, sin) = rotary_.tables(t, x.device());
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer* l = &layers_[i];
    const int unit = 1 + static_cast<int>(i);
    if (gate) gate->gather(unit);
    if (o.checkpoint.whole_layer(static_cast<int64_t>(i)) && c10::GradMode::is_enabled()) {
      ForwardOptions inner = o;
      inner.checkpoint = {};  // nothing nested inside a checkpointed layer
      x = checkpointed([this, l, cos, sin, inner](const at::Tensor& h) { return block(*l, h, cos, sin, inner); }, x);
    } else {
      x = block(*l, x, cos, sin, o);
    }
    if (gate) {
      gate->forward_done(unit);
      x = gate_backward(x, gate, unit);  // backward finds the layer's parameters in place again
    }
  }
  x = norm(x, final_norm_w_, final_norm_b_);
  at::Tensor logits = at::linear(x, head_);
  if (gate) gate->forward_done(0);
  return logits;
}

}  // namespace headroom
