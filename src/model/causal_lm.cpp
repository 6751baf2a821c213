#include "model/causal_lm.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <memory>
#include <optional>

#include "device/storage_adapter.h"
#include "model/activation.h"
#include "model/hf_weights.h"
#include "model/op_checkpoint.h"
#include "util/error.h"

namespace headroom {

namespace {

// A parameter's initial value as Hugging Face draws it, into `out` (float32, on the CPU): norm weights
// one (gemma's, used as 1 + w: zero), biases zero, the rest normal(0, std_dev), the residual
// projections normal(0, proj_std).
void draw_initial(at::Tensor& out, const std::string& name, double std_dev, double proj_std, double norm_weight,
                  const at::Generator& gen) {
  const bool is_norm = name.find("norm.") != std::string::npos;
  const bool is_bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  const bool is_residual_proj =
      name.find("o_proj.weight") != std::string::npos || name.find("down_proj.weight") != std::string::npos;
  const bool lora_a = name.find(".lora_A.") != std::string::npos;
  const bool lora_b = name.find(".lora_B.") != std::string::npos;
  if (lora_a) {
    // peft: kaiming_uniform_(a=sqrt(5)), a bound of 1/sqrt(fan_in)
    const double bound = 1.0 / std::sqrt(static_cast<double>(out.size(1)));
    out.uniform_(-bound, bound, gen);
  } else if (lora_b) out.zero_();
  else if (is_norm && !is_bias) out.fill_(norm_weight);
  else if (is_bias) out.zero_();
  else out.normal_(0.0, is_residual_proj ? proj_std : std_dev, gen);
}

// The same drawn into a new float32 CPU tensor of `sizes`.
at::Tensor initial_value(const std::string& name, at::IntArrayRef sizes, double std_dev, double proj_std,
                         double norm_weight, const at::Generator& gen) {
  at::Tensor cpu = at::empty(sizes, at::TensorOptions().dtype(at::kFloat));
  draw_initial(cpu, name, std_dev, proj_std, norm_weight, gen);
  return cpu;
}

// Initialise each parameter on the CPU from one generator, in registration order, then copy (a float32
// CPU parameter held whole is drawn in place); with `keep`, each parameter holds memory only while it
// is initialised and kept.
// `quantise`: called instead of a copy for an NF4 weight's codes, with the weight's name and its
// dense draw (`dense_sizes` gives its shape); its absmax draws nothing. A tensor-parallel share (`cuts`)
// is drawn whole and cut, so that the ranks' shares are the whole model's of the same seed.
void initialise(std::vector<NamedTensor>& params, const ModelConfig& c, uint64_t seed,
                const CausalLM::KeepParameter& keep, bool base, const std::map<std::string, TensorCut>& cuts,
                const std::function<std::vector<int64_t>(const std::string&)>& dense_sizes,
                const std::function<void(const std::string&, const at::Tensor&)>& quantise) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double std_dev = c.initializer_range;
  const double proj_std = c.family == Family::gpt2 ? std_dev / std::sqrt(2.0 * c.num_layers) : std_dev;
  c10::NoGradGuard no_grad;
  for (auto& [name, t] : params) {
    const bool adapter = is_lora_parameter(name);
    if (!base && !adapter) continue;
    if (is_nf4_part(name)) {
      const std::string weight = nf4_weight_of_codes(name);
      if (weight.empty()) continue;  // an absmax: its codes' draw fills it
      quantise(weight, initial_value(weight, dense_sizes(weight), std_dev, proj_std, 1.0, gen));
      continue;
    }
    const auto cut = cuts.find(name);
    const double norm_weight = c.norm_plus_one ? 0.0 : 1.0;
    if (cut == cuts.end() && t.device().is_cpu() && t.scalar_type() == at::kFloat) {
      // A float32 parameter held whole on the CPU: drawn where it lives, with no copy beside it.
      if (keep) restore_storage(t);
      draw_initial(t, name, std_dev, proj_std, norm_weight, gen);
      if (!keep) continue;
      keep({name, t});
      release_storage(t);
      continue;
    }
    at::Tensor cpu = initial_value(name, cut != cuts.end() ? at::IntArrayRef(cut->second.whole) : t.sizes(), std_dev,
                                   proj_std, norm_weight, gen);
    if (t.is_meta()) continue;  // another pipeline stage's: drawn only to keep the order
    if (cut != cuts.end()) cpu = cut->second.take(cpu);
    if (!keep) {
      t.copy_(cpu);
      continue;
    }
    restore_storage(t);
    t.copy_(cpu);
    keep({name, t});
    release_storage(t);
  }
}

// The adapter and NF4 members of layer `l` (a CausalLM::Layer, const or not) for the module whose
// weight is `weight` ("layers.3.attn.q_proj.weight"): model/lora.h's adaptable_modules() names them.
template <typename Layer>
auto projection_slots(Layer& l, const std::string& weight) {
  const std::string module = weight.substr(weight.find('.', 7) + 1);  // "attn.q_proj.weight"
  auto both = [](auto& lora, auto& nf4) { return std::pair{&lora, &nf4}; };
  return module == "attn.qkv.weight"           ? both(l.lora_qkv, l.nf4_qkv)
         : module == "attn.q_proj.weight"      ? both(l.lora_q, l.nf4_q)
         : module == "attn.k_proj.weight"      ? both(l.lora_k, l.nf4_k)
         : module == "attn.v_proj.weight"      ? both(l.lora_v, l.nf4_v)
         : module == "attn.o_proj.weight"      ? both(l.lora_o, l.nf4_o)
         : module == "mlp.gate_up_proj.weight" ? both(l.lora_gate_up, l.nf4_gate_up)
         : module == "mlp.gate_proj.weight"    ? both(l.lora_gate, l.nf4_gate)
         : module == "mlp.up_proj.weight"      ? both(l.lora_up, l.nf4_up)
                                               : both(l.lora_down, l.nf4_down);
}
template <typename Layer>
auto* adapter_slot(Layer& l, const std::string& weight) {
  return projection_slots(l, weight).first;
}

// The layer a parameter of layers.N. belongs to.
size_t layer_of(const std::string& name) { return std::stoul(name.substr(7, name.find('.', 7) - 7)); }

// The rotary settings of windowed layers with a base of their own (gemma3): that base, unscaled.
ModelConfig local_rotary_config(const ModelConfig& c) {
  ModelConfig local = c;
  if (c.local_rope_theta) {
    local.rope_theta = *c.local_rope_theta;
    local.rope_scaling.reset();
  }
  return local;
}

}  // namespace

at::Tensor CausalLM::add_param(const std::string& name, std::vector<int64_t> shape, int64_t dim,
                               std::vector<Span> spans) {
  if (!spans.empty() && !stage_.tensor.whole()) {
    TensorCut cut{dim, std::move(spans), shape};
    shape = cut.sizes();
    cuts_.emplace(name, std::move(cut));
  }
  if (base_weights_ == BaseWeights::nf4 && name.rfind("layers.", 0) == 0) {
    Layer& l = layers_[layer_of(name)];
    for (const AdaptableModule& m : adaptable_modules(config_, static_cast<int64_t>(layer_of(name)))) {
      if (m.weight != name) continue;
      // Held in NF4: its codes and absmax in its place, the dense member left undefined.
      Nf4Weight& w = *projection_slots(l, name).second;
      const int64_t n = m.out * m.in;
      w.sizes = {m.out, m.in};
      w.dtype = options_.dtype().toScalarType();
      w.codes = at::empty({nf4_code_bytes(n)}, options_.dtype(at::kByte));
      w.absmax = at::empty({nf4_blocks(n)}, options_.dtype(at::kFloat));
      params_.push_back({nf4_codes_name(name), w.codes});
      params_.push_back({nf4_absmax_name(name), w.absmax});
      return {};
    }
  }
  // Another pipeline stage's parameter: a shape without memory, dropped once the draws are done.
  // With `keep`, memory only while it is initialised (made without any until then).
  const at::TensorOptions where = holds(name) ? options_ : options_.device(at::kMeta);
  at::Tensor t = release_ && !where.device().is_meta() ? empty_shell(shape, where) : at::empty(shape, where);
  params_.push_back({name, t});
  return t;
}

CausalLM::CausalLM(const ModelConfig& config, const at::TensorOptions& options, uint64_t seed,
                   const KeepParameter& keep, const Finetune& finetune, bool initialise_base,
                   BaseWeights base_weights, const ModelStage& stage)
    : config_(config), stage_(stage), finetune_(finetune), base_weights_(base_weights), options_(options), release_(static_cast<bool>(keep)), rotary_(config), local_rotary_(local_rotary_config(config)) {
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size;
  const bool layer_norm = c.norm == NormKind::layer_norm;
  if (base_weights_ == BaseWeights::nf4 && !stage_.whole(c.num_layers)) {
    fail("--base-weights nf4 with --pipeline or --tensor-parallel: not supported");
  }
  const TensorSlice& tp = stage_.tensor;
  if (!tp.whole()) {
    check_tensor_parallel(c, tp.ranks);
    if (finetune_.is_lora()) fail("--finetune {} with --tensor-parallel: not supported yet", finetune_.name());
  }
  if (stage_.end < 0) stage_.end = c.num_layers;
  TORCH_CHECK(stage_.first >= 0 && stage_.first < stage_.end && stage_.end <= c.num_layers,
              "CausalLM: stage layers [", stage_.first, ", ", stage_.end, ") outside the model's ", c.num_layers);
  const Shares shares = shares_of(c, tp);
  heads_ = shares.heads.size;
  kv_heads_ = shares.kv_heads.size;

  // Allocate on the target device directly; init happens after, on CPU copies.
  embed_ = add_param("embed_tokens.weight", {c.vocab_size, d}, 0, {shares.vocab});
  if (c.learned_positions) pos_embed_ = add_param("embed_positions.weight", {c.max_positions, d});
  layers_.resize(static_cast<size_t>(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) add_layer(i, shares);
  final_norm_w_ = add_param("final_norm.weight", {d});
  if (layer_norm) final_norm_b_ = add_param("final_norm.bias", {d});
  head_ = c.tie_word_embeddings ? embed_ : add_param("lm_head.weight", {c.vocab_size, d}, 0, {shares.vocab});
  if (finetune_.is_lora()) add_adapters();

  if (base_weights_ == BaseWeights::nf4 && (!finetune_.is_lora() || keep)) {
    fail("--base-weights nf4 needs --finetune lora:... on one process (the 4-bit base is frozen, not sharded)");
  }
  if (!options_.device().is_meta()) {
    initialise(
        params_, c, seed, keep, initialise_base, cuts_, [this](const std::string& w) { return nf4_weight(w)->sizes; },
        [this](const std::string& w, const at::Tensor& dense) { quantise(w, dense); });
  }
  std::erase_if(params_, [this](const NamedTensor& p) { return !holds(p.name); });
  mark_trainable();
}

CausalLM::Shares CausalLM::shares_of(const ModelConfig& c, const TensorSlice& tp) {
  // Tensor parallel: this rank's query rows, key/value rows, inner columns and vocabulary rows.
  const int64_t hd = c.head_dim;
  const Span heads = tp.heads(c.num_heads), kv = tp.whole() ? Span{0, c.num_kv_heads} : tp.kv_heads(c);
  return Shares{heads,
                kv,
                {heads.begin * hd, heads.size * hd},
                {kv.begin * hd, kv.size * hd},
                tp.share(c.intermediate_size),
                tp.vocab(c.vocab_size)};
}

void CausalLM::add_layer(int64_t i, const Shares& shares) {
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size;
  const bool layer_norm = c.norm == NormKind::layer_norm;
  const bool pre_norms = c.norm_placement != NormPlacement::post;
  const bool out_norms = c.norm_placement != NormPlacement::pre;
  Layer& l = layers_[static_cast<size_t>(i)];
  const std::string p = fmt::format("layers.{}.", i);
  if (c.windowed(i)) l.window = c.sliding_window;
  l.local_rope = c.windowed(i) && c.local_rope_theta.has_value();
  l.rotary = c.rotated(i);
  if (pre_norms) {
    l.norm1_w = add_param(p + "input_norm.weight", {d});
    if (layer_norm) l.norm1_b = add_param(p + "input_norm.bias", {d});
  }
  add_attention(l, p, shares);
  if (out_norms) l.attn_out_norm_w = add_param(p + "attention_out_norm.weight", {d});
  if (pre_norms) {
    l.norm2_w = add_param(p + "post_attention_norm.weight", {d});
    if (layer_norm) l.norm2_b = add_param(p + "post_attention_norm.bias", {d});
  }
  if (c.sparse(i)) {
    add_experts(l, p);
  } else {
    add_mlp(l, p, shares.inner);
  }
  if (out_norms) l.mlp_out_norm_w = add_param(p + "mlp_out_norm.weight", {d});
}

void CausalLM::add_attention(Layer& l, const std::string& p, const Shares& shares) {
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size, hd = c.head_dim;
  const int64_t q_dim = c.num_heads * hd, kv_dim = c.num_kv_heads * hd;
  const Span q_rows = shares.q_rows, kv_rows = shares.kv_rows;
  if (c.fused_qkv) {
    // gpt_neox interleaves q, k and v per head; the others lay out all of q, then k, then v.
    const std::vector<Span> qkv_rows =
        c.family == Family::gpt_neox
            ? std::vector<Span>{{shares.heads.begin * 3 * hd, shares.heads.size * 3 * hd}}
            : std::vector<Span>{
                  q_rows, {q_dim + kv_rows.begin, kv_rows.size}, {q_dim + kv_dim + kv_rows.begin, kv_rows.size}};
    l.qkv_w = add_param(p + "attn.qkv.weight", {q_dim + 2 * kv_dim, d}, 0, qkv_rows);
    if (c.qkv_bias) l.qkv_b = add_param(p + "attn.qkv.bias", {q_dim + 2 * kv_dim}, 0, qkv_rows);
  } else {
    l.q_w = add_param(p + "attn.q_proj.weight", {q_dim, d}, 0, {q_rows});
    if (c.qkv_bias) l.q_b = add_param(p + "attn.q_proj.bias", {q_dim}, 0, {q_rows});
    l.k_w = add_param(p + "attn.k_proj.weight", {kv_dim, d}, 0, {kv_rows});
    if (c.qkv_bias) l.k_b = add_param(p + "attn.k_proj.bias", {kv_dim}, 0, {kv_rows});
    l.v_w = add_param(p + "attn.v_proj.weight", {kv_dim, d}, 0, {kv_rows});
    if (c.qkv_bias) l.v_b = add_param(p + "attn.v_proj.bias", {kv_dim}, 0, {kv_rows});
  }
  if (c.qk_norm != QkNorm::none) {
    const bool per_head = c.qk_norm == QkNorm::per_head;
    l.q_norm_w = add_param(p + "attn.q_norm.weight", {per_head ? hd : q_dim});
    l.k_norm_w = add_param(p + "attn.k_norm.weight", {per_head ? hd : kv_dim});
  }
  l.o_w = add_param(p + "attn.o_proj.weight", {d, q_dim}, 1, {q_rows});
  if (c.out_bias) l.o_b = add_param(p + "attn.o_proj.bias", {d});
}

void CausalLM::add_experts(Layer& l, const std::string& p) {
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size, e_inter = c.moe->intermediate_size;
  l.router_w = add_param(p + "mlp.router.weight", {c.moe->experts, d});
  l.experts.resize(static_cast<size_t>(c.moe->experts));
  for (int64_t e = 0; e < c.moe->experts; ++e) {
    const std::string ep = fmt::format("{}mlp.experts.{}.", p, e);
    Expert& x = l.experts[static_cast<size_t>(e)];
    x.gate_w = add_param(ep + "gate_proj.weight", {e_inter, d});
    x.up_w = add_param(ep + "up_proj.weight", {e_inter, d});
    x.down_w = add_param(ep + "down_proj.weight", {d, e_inter});
  }
}

void CausalLM::add_mlp(Layer& l, const std::string& p, const Span& inner) {
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size, inter = c.intermediate_size;
  if (c.fused_gate_up) {
    l.gate_up_w =
        add_param(p + "mlp.gate_up_proj.weight", {2 * inter, d}, 0, {inner, {inter + inner.begin, inner.size}});
  } else if (c.gated_mlp) {
    l.gate_w = add_param(p + "mlp.gate_proj.weight", {inter, d}, 0, {inner});
    if (c.mlp_bias) l.gate_b = add_param(p + "mlp.gate_proj.bias", {inter}, 0, {inner});
  }
  if (!c.fused_gate_up) {
    l.up_w = add_param(p + "mlp.up_proj.weight", {inter, d}, 0, {inner});
    if (c.mlp_bias) l.up_b = add_param(p + "mlp.up_proj.bias", {inter}, 0, {inner});
  }
  l.down_w = add_param(p + "mlp.down_proj.weight", {d, inter}, 1, {inner});
  if (c.mlp_bias) l.down_b = add_param(p + "mlp.down_proj.bias", {d});
}

void CausalLM::add_adapters() {
  const LoraSettings& lora = finetune_.lora;
  bool sparse = false;
  for (int64_t i = 0; i < config_.num_layers; ++i) sparse |= config_.sparse(i);
  if (sparse && lora.targets_any({Projection::gate, Projection::up, Projection::down})) {
    // peft (0.21, with transformers 5) adapts the experts' 3-D tensors themselves: one adapter per
    // expert, of rank 2r on the fused gate_up. headroom does not yet, and would not count as peft does.
    fail("--finetune {}: LoRA on a mixture of experts' MLPs (gate, up, down) is not supported yet; accepted: "
         "targets among q,k,v,o for {}",
         finetune_.name(), config_.name);
  }
  bool any = false;
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    Layer& l = layers_[static_cast<size_t>(i)];
    for (const AdaptableModule& m : adaptable_modules(config_, i)) {
      bool targeted = false;
      for (Projection role : m.roles) targeted |= lora.targets_any({role});
      if (!targeted) continue;
      LoraAdapter* slot = adapter_slot(l, m.weight);
      slot->a = add_param(lora_a_name(m.weight), {lora.r, m.in});
      slot->b = add_param(lora_b_name(m.weight), {m.out, lora.r});
      any = true;
    }
  }
  if (!any) {
    std::vector<std::string> roles;
    for (Projection p : lora.targets) roles.emplace_back(projection_name(p));
    fail("--finetune {}: {} has no projection of the targets {} to adapt; accepted: q, k, v, o (and gate, up, down "
         "where the MLP is not a mixture of experts)",
         finetune_.name(), config_.name, fmt::join(roles, ","));
  }
}

void CausalLM::mark_trainable() {
  std::vector<bool> used(finetune_.freeze.size(), false);
  for (auto& [name, t] : params_) {
    bool trains = true;
    if (finetune_.is_lora()) {
      trains = is_lora_parameter(name);
    } else if (finetune_.kind == Finetune::Kind::freeze) {
      const std::string theirs = hf_parameter_name(name, config_);
      for (size_t k = 0; k < finetune_.freeze.size(); ++k) {
        if (glob_match(finetune_.freeze[k], name) || glob_match(finetune_.freeze[k], theirs)) {
          trains = false;
          used[k] = true;
        }
      }
    }
    t.requires_grad_(trains);
  }
  for (size_t k = 0; k < used.size(); ++k) {
    if (!used[k]) {
      fail("--finetune {}: '{}' matches no parameter of {}; patterns are globs over whole names, such as "
           "'embed_tokens.weight', 'layers.0.*' or Hugging Face's 'model.layers.*.self_attn.*'",
           finetune_.name(), finetune_.freeze[k], config_.name);
    }
  }
}

std::vector<CausalLM::Adapted> CausalLM::adapters() const {
  std::vector<Adapted> out;
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const Layer& l = layers_[static_cast<size_t>(i)];
    for (const AdaptableModule& m : adaptable_modules(config_, i)) {
      const LoraAdapter& a = *adapter_slot(l, m.weight);
      if (a.defined()) out.push_back({m.weight, a});
    }
  }
  return out;
}

at::Tensor CausalLM::project(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const LoraAdapter& lora,
                             const Nf4Weight& nf4, const ForwardOptions& o) const {
  // Without a bias a projection is aten::mm, which per-op checkpointing counts (model/op_checkpoint.h).
  const at::Tensor y = nf4.defined() ? nf4_linear(x, nf4, b) : b.defined() ? at::linear(x, w, b) : op_matmul(x, w);
  return lora_project(x, y, lora, finetune_.lora, o.training);
}

const Nf4Weight* CausalLM::nf4_weight(const std::string& name) const {
  if (base_weights_ != BaseWeights::nf4 || name.rfind("layers.", 0) != 0) return nullptr;
  const size_t layer = layer_of(name);
  if (layer >= layers_.size()) return nullptr;
  for (const AdaptableModule& m : adaptable_modules(config_, static_cast<int64_t>(layer))) {
    if (m.weight == name) return projection_slots(layers_[layer], name).second;
  }
  return nullptr;
}

std::vector<std::string> CausalLM::nf4_weights() const {
  std::vector<std::string> out;
  for (const auto& p : params_) {
    if (std::string w = nf4_weight_of_codes(p.name); !w.empty()) out.push_back(std::move(w));
  }
  return out;
}

void CausalLM::quantise(const std::string& name, const at::Tensor& dense) {
  const Nf4Weight* w = nf4_weight(name);
  if (w == nullptr) fail("'{}' is not held in NF4", name);
  Nf4Weight& target = *projection_slots(layers_[layer_of(name)], name).second;
  nf4_quantise_into(dense.device() == target.codes.device() ? dense : dense.to(target.codes.device()), target);
}

bool CausalLM::holds(const std::string& name) const {
  if (name.rfind("layers.", 0) == 0) {
    const auto layer = static_cast<int64_t>(layer_of(name));
    return layer >= stage_.first && (stage_.end < 0 || layer < stage_.end);
  }
  if (name == "embed_tokens.weight") return stage_.embeddings || (stage_.head && config_.tie_word_embeddings);
  if (name == "embed_positions.weight") return stage_.embeddings;
  return stage_.head;  // the final norm, the head
}

int64_t CausalLM::tensor_copies(const std::string& name) const {
  const TensorSlice& tp = stage_.tensor;
  if (tp.whole()) return 1;
  if (!cuts_.contains(name)) return tp.ranks;
  const bool kv = name.find("attn.k_proj.") != std::string::npos || name.find("attn.v_proj.") != std::string::npos;
  return kv && tp.kv_replicated(config_) ? tp.ranks / config_.num_kv_heads : 1;
}

at::Tensor CausalLM::share_of(const std::string& name, const at::Tensor& whole) const {
  const auto cut = cuts_.find(name);
  return cut == cuts_.end() ? whole : cut->second.take(whole);
}

int64_t CausalLM::counted_elements(const NamedTensor& p) const {
  if (!is_nf4_part(p.name)) return p.tensor.numel();
  const std::string w = nf4_weight_of_codes(p.name);
  return w.empty() ? 0 : nf4_weight(w)->numel();
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
  for (const auto& p : params_) n += counted_elements(p);
  return n;
}

int64_t CausalLM::num_trainable_parameters() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.tensor.requires_grad() ? p.tensor.numel() : 0;
  return n;
}

std::vector<NamedTensor> CausalLM::trainable_parameters() const {
  std::vector<NamedTensor> out;
  for (const auto& p : params_)
    if (p.tensor.requires_grad()) out.push_back(p);
  return out;
}

}  // namespace headroom
