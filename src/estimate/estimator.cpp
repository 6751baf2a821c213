#include "estimate/estimator.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <unordered_map>

#include "config/run_config.h"
#include "data/embedded.h"
#include "device/device.h"
#include "estimate/ops.h"
#include "model/causal_lm.h"
#include "optim/optimizer.h"
#include "util/error.h"
#include "util/size.h"

namespace headroom {
namespace {

using sim::Category;
using sim::Emit;
using sim::Ref;
using sim::Tensor;

constexpr int64_t kCpuRngStateBytes = 5056;  // at::CPUGeneratorImpl state as a byte tensor
constexpr int64_t kCudaRngStateBytes = 16;   // Philox seed and offset
constexpr int64_t kCublasWorkspaceBytes = int64_t{4096} * 1024 * 8;

using sim::AttentionShape;
using sim::Param;

bool is_mixed(Precision p) { return p == Precision::bf16_mixed || p == Precision::fp16_mixed; }

// One simulated step of the trainer, mirroring CausalLM::forward and train()'s step loop, composed
// of the operator models of estimate/ops.h.
class StepSim : sim::Ops {
 public:
  StepSim(const ModelConfig& c, const TrainSpec& s) : sim::Ops(is_mixed(s.precision)), c_(c), s_(s) {
    ew_ = s.precision == Precision::bf16 ? 2 : 4;
    const std::string w = fmt::format("{} B each", ew_);
    weights_ = mem_.label("weights", Category::weights, "parameters × " + w);
    grads_ = mem_.label("gradients", Category::gradients, "parameters × " + w + ", filled as backward reaches them");
    if (s.cuda) {
      mem_.set_rounding(512, mem_.label("allocator rounding", Category::allocator,
                                        "the CUDA caching allocator rounds every block up to 512 bytes"));
    }
  }

  Estimate run();

 private:
  Tensor attention_block(int64_t layer, const Tensor& x, const Tensor& cos, const Tensor& sin);
  Tensor mlp_block(int64_t layer, const Tensor& x);
  Tensor block(int64_t layer, const Tensor& x, const Tensor& cos, const Tensor& sin, bool inner_checkpoint);
  Tensor checkpointed(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x);
  Tensor forward(int64_t rows);
  void micro_batch(int64_t rows);
  void setup();
  void optimizer_phase();
  void torch_update_temporaries();

  // Data parallel (dist/data_parallel.cpp, step for step).
  bool sharded() const { return s_.world > 1 && s_.shard != ShardLevel::none; }
  // gradients, full: each gradient reduce-scattered during backward; full: the weights sharded too.
  bool reduces_in_backward() const {
    return s_.world > 1 && (s_.shard == ShardLevel::gradients || s_.shard == ShardLevel::full);
  }
  bool fully_sharded() const { return s_.world > 1 && s_.shard == ShardLevel::full; }
  // full (model/parameter_gate.h, as DataParallel does it): a unit's parameters all-gathered, let go.
  void gather(int unit);
  void release(int unit);
  void forward_done(int unit) {
    if (unit != 0 || !g_->grad_mode()) release(unit);
  }
  Tensor gate_backward(const Tensor& x, int unit);
  int64_t chunk(int64_t numel) const { return (numel + s_.world - 1) / s_.world; }
  void reduce_scatter(size_t i, bool zeros);
  void gradient_ready(size_t i);
  void finish_backward();
  void allreduce_buckets();
  void gather_parameters();
  // The transients of one all-gather of a parameter of n elements in chunks of c
  // (DataParallel::allgather_into): the result padded to N chunks unless that is the parameter.
  void allgather(int64_t n, int64_t c);
  void agreement() { Ref flag = mem_.allocate(8, comm_); }  // a one-element int64 allreduce

  const Param& p(const std::string& name) const {
    auto it = params_.find(name);
    if (it == params_.end()) fail("estimator: the model has no parameter '{}'", name);
    return it->second;
  }
  const Param* maybe(const std::string& name) const {
    auto it = params_.find(name);
    return it == params_.end() ? nullptr : &it->second;
  }

  Tensor norm(const Tensor& x, const Param& w, const Param* b) {
    return c_.norm == NormKind::layer_norm ? layer_norm(x, w, b) : rms_norm(x, w);
  }

  const ModelConfig& c_;
  const TrainSpec& s_;
  int ew_ = 4;  // parameter bytes
  int weights_, grads_;
  std::map<std::string, Param> params_;
  std::vector<std::string> order_;  // parameter names in registration order
  Ref dataset_, dataset_eval_;
  Ref workspace_;  // cuda: cuBLAS's
  std::unique_ptr<CausalLM> shapes_;  // the model on the meta device
  int comm_ = -1;        // label of the collectives' buffers
  Ref shard_;            // sharded: this rank's reduced gradients, one chunk per parameter
  std::vector<bool> ready_;  // gradients: accumulated this backward, not yet reduced
  size_t next_ = 0;          // gradients: reductions issued this backward (last parameter first)
  // full
  std::vector<Ref> slices_;  // per parameter (order_): rank 0's weight slice
  std::vector<int> units_;   // per parameter (order_): its unit
  std::vector<std::vector<size_t>> unit_params_;
  std::vector<std::vector<Ref>> gathered_;  // per unit: its parameters in full, while gathered
  std::vector<size_t> arrived_;             // per unit: gradients accumulated this backward
  int gathered_lbl_ = -1;
};

Tensor StepSim::attention_block(int64_t layer, const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const std::string pre = fmt::format("layers.{}.attn.", layer);
  const int64_t tokens = x.numel / c_.hidden_size;
  const AttentionShape shape{tokens / s_.seq, s_.seq, c_.num_heads, c_.num_kv_heads, c_.head_dim};
  const int64_t qw = c_.num_heads * c_.head_dim, kw = c_.num_kv_heads * c_.head_dim;
  const int qkv_lbl =
      act("attention q, k, v", "queries, keys and values (after rotary), B·T·(heads + 2·kv_heads)·head_dim");
  Tensor q, k, v;
  if (c_.fused_qkv) {
    Tensor qkv = linear(x, p(pre + "qkv.weight"), maybe(pre + "qkv.bias"), qkv_lbl);
    q = g_->alias(qkv, tokens * qw);
    k = g_->alias(qkv, tokens * kw);
    v = g_->alias(qkv, tokens * kw);
    // split/chunk backward: the three gradients are concatenated into one.
    g_->record({&q, &k, &v}, {},
               [this, qkv = meta(qkv)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(qkv)}; });
  } else {
    q = linear(x, p(pre + "q_proj.weight"), maybe(pre + "q_proj.bias"), qkv_lbl);
    k = linear(x, p(pre + "k_proj.weight"), maybe(pre + "k_proj.bias"), qkv_lbl);
    v = linear(x, p(pre + "v_proj.weight"), maybe(pre + "v_proj.bias"), qkv_lbl);
  }
  const bool rotated = !c_.learned_positions;
  if (rotated) {
    q = rotary(q, c_.num_heads, c_.head_dim, c_.rotary_dim, cos, sin);
    k = rotary(k, c_.num_kv_heads, c_.head_dim, c_.rotary_dim, cos, sin);
  }
  const bool windowed = layer >= c_.window_from_layer && c_.sliding_window && *c_.sliding_window < s_.seq;
  Tensor y;
  if (s_.attention == AttentionPath::math) {
    y = explicit_attention(q, k, v, shape, windowed, c_.attn_dropout);
  } else if (c_.attn_dropout > 0) {
    y = math_fallback_attention(q, k, v, shape, c_.attn_dropout);  // the fused kernel has no dropout on cpu
  } else {
    y = fused_attention(q, k, v, shape, windowed, rotated && c_.rotary_dim != c_.head_dim);
  }
  q = k = v = Tensor{};
  const int res_lbl = act("residual stream", "block outputs and residual sums, B·T·hidden each");
  Tensor o = linear(y, p(pre + "o_proj.weight"), maybe(pre + "o_proj.bias"), res_lbl);
  return dropout(o, c_.resid_dropout, res_lbl);
}

Tensor StepSim::mlp_block(int64_t layer, const Tensor& x) {
  const std::string pre = fmt::format("layers.{}.mlp.", layer);
  const int lbl = act("MLP activations", "up/gate projections and activation outputs, B·T·intermediate each");
  const bool relu = c_.activation == Activation::relu;
  Tensor h;
  if (c_.gated_mlp) {
    Tensor gate = activation(linear(x, p(pre + "gate_proj.weight"), maybe(pre + "gate_proj.bias"), lbl), relu);
    Tensor up = linear(x, p(pre + "up_proj.weight"), maybe(pre + "up_proj.bias"), lbl);
    h = mul(gate, up, lbl);
  } else {
    h = activation(linear(x, p(pre + "up_proj.weight"), maybe(pre + "up_proj.bias"), lbl), relu);
  }
  const int res_lbl = act("residual stream", "block outputs and residual sums, B·T·hidden each");
  Tensor d = linear(h, p(pre + "down_proj.weight"), maybe(pre + "down_proj.bias"), res_lbl);
  return dropout(d, c_.resid_dropout, res_lbl);
}

Tensor StepSim::checkpointed(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x) {
  if (!x.requires_grad() || !g_->grad_mode()) return fn(x);
  const int64_t rng_bytes = s_.cuda ? kCudaRngStateBytes : kCpuRngStateBytes;
  const int lbl = act("checkpoint inputs", "each checkpointed block keeps its input and the RNG state");
  Ref rng = mem_.allocate(rng_bytes, lbl);
  g_->set_grad_mode(false);
  Tensor y = fn(x);
  g_->set_grad_mode(true);
  y.slot = std::make_shared<sim::GradSlot>();
  y.slot->numel = y.numel;
  y.slot->elem = y.elem;
  g_->record({&y}, {x.buf, rng}, [this, fn, x, rng_bytes](const std::vector<Ref>& in) {
    // Recompute under grad mode (and a fresh autocast cache), then backpropagate through it.
    // The generator state to put back afterwards, and the saved one being replayed.
    Ref restore = mem_.allocate(rng_bytes, tmp_), replayed = mem_.allocate(rng_bytes, tmp_);
    sim::Graph inner(mem_);
    sim::Graph* outer = g_;
    std::map<const Param*, Tensor> cache;
    auto* outer_cache = cache_;
    g_ = &inner;
    cache_ = &cache;
    Tensor input = x;
    input.slot = std::make_shared<sim::GradSlot>();
    input.slot->numel = x.numel;
    input.slot->elem = x.elem;
    Tensor out = fn(view(input));
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

Tensor StepSim::block(int64_t layer, const Tensor& x, const Tensor& cos, const Tensor& sin, bool selective) {
  const std::string pre = fmt::format("layers.{}.", layer);
  const int res_lbl = act("residual stream", "block outputs and residual sums, B·T·hidden each");
  const Param& n1 = p(pre + "input_norm.weight");
  const Param* n1b = maybe(pre + "input_norm.bias");
  const Param& n2 = p(pre + "post_attention_norm.weight");
  const Param* n2b = maybe(pre + "post_attention_norm.bias");
  auto attend = [&](const Tensor& normed) {
    if (!selective || !g_->grad_mode()) return attention_block(layer, normed, cos, sin);
    return checkpointed([this, layer, cos, sin](const Tensor& h) { return attention_block(layer, h, cos, sin); },
                        normed);
  };
  if (c_.parallel_residual) {
    Tensor with_attn = add(x, attend(norm(x, n1, n1b)), res_lbl);
    Tensor m = mlp_block(layer, norm(x, n2, n2b));
    return add(with_attn, m, res_lbl);
  }
  Tensor h = add(x, attend(norm(x, n1, n1b)), res_lbl);
  return add(h, mlp_block(layer, norm(h, n2, n2b)), res_lbl);
}

Tensor StepSim::forward(int64_t rows) {
  const int64_t t = s_.seq, tokens = rows * t, h = c_.hidden_size;
  const int res_lbl = act("residual stream", "block outputs and residual sums, B·T·hidden each");
  const Param& embed = p("embed_tokens.weight");
  if (fully_sharded()) gather(0);
  Tensor x = embedding(embed, tokens, ew_, res_lbl);
  if (c_.learned_positions) {
    const Param& pos = p("embed_positions.weight");
    Ref arange = mem_.allocate(t * 8, tmp_);
    Tensor pe = make(t * h, ew_, tmp_);
    g_->record({&pe}, {}, [this, &pos](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(pos.t)}; });
    x = add(x, pe, res_lbl);
  }
  x = dropout(x, c_.embd_dropout, res_lbl);
  Tensor cos, sin;
  if (!c_.learned_positions) {
    const int64_t rd = c_.rotary_dim;
    const int lbl = act("rotary tables", "cos and sin, seq × rotary_dim");
    Ref inv = mem_.allocate(rd / 2 * 4, tmp_), pos = mem_.allocate(t * 4, tmp_);
    Ref freqs = mem_.allocate(t * rd / 2 * 4, tmp_), emb = mem_.allocate(t * rd * 4, tmp_);
    cos = make(t * rd, 4, lbl, false);
    sin = make(t * rd, 4, lbl, false);
  }
  for (int64_t i = 0; i < c_.num_layers; ++i) {
    const int unit = 1 + static_cast<int>(i);
    if (fully_sharded()) gather(unit);
    if (s_.checkpointing.whole_layer(i) && g_->grad_mode()) {
      x = checkpointed([this, i, cos, sin](const Tensor& in) { return block(i, in, cos, sin, false); }, x);
    } else {
      x = block(i, x, cos, sin, s_.checkpointing.attention_only());
    }
    if (fully_sharded()) {
      forward_done(unit);
      x = gate_backward(x, unit);
    }
  }
  x = norm(x, p("final_norm.weight"), maybe("final_norm.bias"));
  const int logits_lbl = mem_.label("logits", Category::logits, "B·T·vocab in the matmul dtype");
  Tensor logits = linear(x, c_.tie_word_embeddings ? embed : p("lm_head.weight"), nullptr, logits_lbl);
  if (fully_sharded()) forward_done(0);
  return logits;
}

void StepSim::micro_batch(int64_t rows) {
  const int64_t t = s_.seq, tokens = rows * t, vocab = c_.vocab_size;
  const int batch_lbl = mem_.label("batch", Category::other, "token ids, B·(T+1) int64, and the targets' copy");
  const int loss_lbl = mem_.label("loss buffers", Category::loss,
                                  "float32 log-softmax kept for backward, B·T·vocab × 4, and its gradient");
  mem_.set_phase(Phase::data);
  if (reduces_in_backward()) {
    ready_.assign(order_.size(), false);
    std::fill(arrived_.begin(), arrived_.end(), 0);
    next_ = 0;
  }
  Ref batch = mem_.allocate(rows * (t + 1) * 8, batch_lbl);
  Tensor loss;
  {
    mem_.set_phase(Phase::forward);
    std::map<const Param*, Tensor> cache;
    cache_ = &cache;
    loss = token_loss(forward(rows), tokens, vocab, batch_lbl, loss_lbl);
    cache.clear();
    cache_ = nullptr;
  }
  mem_.set_phase(Phase::backward);
  Tensor root = scale(loss, tmp_);
  if (s_.precision == Precision::fp16_mixed) root = scale(root, tmp_);
  loss = Tensor{};
  g_->backward(root);
  root = Tensor{};
  if (s_.world > 1) {
    finish_backward();
    agreement();
  }
}

void StepSim::reduce_scatter(size_t i, bool zeros) {
  Param& prm = params_.at(order_[i]);
  const int64_t n = prm.t.numel, c = chunk(n);
  Ref grad = zeros ? nullptr : prm.t.slot->grad;
  // Padded to N chunks in a zeroed copy unless the gradient already is exactly that.
  Ref input = (!grad || c * s_.world != n) ? mem_.allocate(c * s_.world * ew_, comm_) : nullptr;
  Ref output = mem_.allocate(c * ew_, comm_);
  if (!s_.cuda) {
    // Gloo reduce-scatters by reducing a flat copy of the whole input and copying this rank's chunk
    // out of it into the output: one transient of the input's size (measured: gpt_neox's untied
    // 50304 x 768 head at 2 ranks; no second, chunk-sized one).
    Ref copy = mem_.allocate(c * s_.world * ew_, comm_);
  }
  if (reduces_in_backward()) ++next_;
  if (!zeros) prm.t.slot->grad.reset();
  output.reset();
  input.reset();
}

void StepSim::gradient_ready(size_t i) {
  ready_[i] = true;
  while (next_ < order_.size() && ready_[order_.size() - 1 - next_]) reduce_scatter(order_.size() - 1 - next_, false);
  if (fully_sharded()) {
    const auto unit = static_cast<size_t>(units_[i]);
    if (++arrived_[unit] == unit_params_[unit].size()) release(static_cast<int>(unit));
  }
}

void StepSim::finish_backward() {
  if (!reduces_in_backward()) return;
  while (next_ < order_.size()) reduce_scatter(order_.size() - 1 - next_, true);
  for (size_t u = 0; u < gathered_.size(); ++u) release(static_cast<int>(u));
}

void StepSim::gather(int unit) {
  auto& held = gathered_.at(static_cast<size_t>(unit));
  if (!held.empty()) return;
  for (size_t i : unit_params_[static_cast<size_t>(unit)]) {
    const int64_t n = params_.at(order_[i]).t.numel, c = chunk(n);
    held.push_back(mem_.allocate(n * ew_, gathered_lbl_));
    allgather(n, c);  // rank 0's slice is a whole chunk: sent as it is, unpadded
  }
}

void StepSim::release(int unit) { gathered_.at(static_cast<size_t>(unit)).clear(); }

Tensor StepSim::gate_backward(const Tensor& x, int unit) {
  if (!x.requires_grad() || !g_->grad_mode()) return x;
  // An identity whose backward gathers the layer first; its output a view of x.
  Tensor y = g_->alias(x, x.numel);
  g_->record({&y}, {}, [this, unit, x = meta(x)](const std::vector<Ref>& in) {
    gather(unit);
    return std::vector<Emit>{pass_to(x, in[0])};
  });
  return y;
}

void StepSim::allreduce_buckets() {
  constexpr int64_t kBucketBytes = int64_t{25} << 20;
  std::vector<int64_t> bucket;
  auto flush = [&] {
    // One gradient is reduced in place; several are copied into one flat buffer and back.
    if (bucket.size() > 1) {
      int64_t bytes = 0;
      for (int64_t b : bucket) bytes += b;
      Ref flat = mem_.allocate(bytes, comm_);
    }
    bucket.clear();
  };
  int64_t bytes = 0;
  for (size_t k = order_.size(); k-- > 0;) {
    const int64_t g = params_.at(order_[k]).t.numel * ew_;
    if (!bucket.empty() && bytes + g > kBucketBytes) {
      flush();
      bytes = 0;
    }
    bucket.push_back(g);
    bytes += g;
  }
  flush();
}

void StepSim::gather_parameters() {
  for (const auto& name : order_) {
    const int64_t n = params_.at(name).t.numel, c = chunk(n);
    Ref input = mem_.allocate(c * ew_, comm_);
    allgather(n, c);
  }
}

void StepSim::allgather(int64_t n, int64_t c) {
  Ref output = c * s_.world != n ? mem_.allocate(c * s_.world * ew_, comm_) : nullptr;
  // On cpu Gloo gathers into a flat tensor of its own and copies the result out of it.
  if (!s_.cuda) Ref flat = mem_.allocate(c * s_.world * ew_, comm_);
}

void StepSim::setup() {
  if (!s_.cuda && s_.dataset_bytes > 0) {
    // As TextDataset loads it: the whole corpus, then its train and held-out parts cloned out of it
    // (10% held out), then the whole freed. Live bytes end where they began; a caching allocator's
    // blocks do not.
    const int lbl = mem_.label("dataset", Category::other, "the corpus in host memory, 1 B per token");
    const int64_t n = s_.dataset_bytes, held_out = static_cast<int64_t>(static_cast<double>(n) * 0.1);
    Ref all = mem_.allocate(n, lbl);
    dataset_ = mem_.allocate(n - held_out, lbl);
    dataset_eval_ = mem_.allocate(held_out, lbl);
  }
  // Shapes from the trainer's own model class on the meta device: nothing allocated.
  shapes_ =
      std::make_unique<CausalLM>(c_, at::TensorOptions().device(at::kMeta).dtype(parameter_dtype(s_.precision)), 0);
  for (const auto& np : shapes_->parameters()) {
    if (params_.count(np.name) != 0) continue;  // a tied head repeats the embedding
    Param prm;
    prm.rows = np.tensor.size(0);
    prm.cols = np.tensor.dim() == 2 ? np.tensor.size(1) : 0;
    prm.t.numel = np.tensor.numel();
    prm.t.elem = ew_;
    // full: the parameter holds nothing between uses; the rank's slice is its weight (below).
    if (!fully_sharded()) prm.t.buf = mem_.allocate(prm.t.numel * ew_, weights_);
    prm.t.slot = std::make_shared<sim::GradSlot>();
    prm.t.slot->numel = prm.t.numel;
    prm.t.slot->elem = ew_;
    prm.t.slot->param_label = grads_;
    params_.emplace(np.name, prm);
    order_.push_back(np.name);
  }
  // A tied head is the embedding used a second time: two gradients arrive for it per backward.
  if (c_.tie_word_embeddings) params_.at("embed_tokens.weight").t.slot->uses = 2;
  // CausalLM initialises each parameter in a float32 copy, one at a time, in registration order:
  // nothing at the peak, but a caching allocator keeps the largest copy's segment.
  const int init = mem_.label("initialisation copies", Category::temporaries, "one float32 parameter at a time");
  for (const auto& name : order_) Ref copy = mem_.allocate(params_.at(name).t.numel * 4, init);
  if (s_.world > 1) {
    comm_ = mem_.label("communication buffers", Category::communication,
                       "the collectives' flat buckets (unsharded: up to 25 MiB), padded gradients and "
                       "gathered parameters (sharded: one parameter at a time)");
  }
  if (sharded()) {
    int64_t elements = 0;
    for (const auto& name : order_) elements += chunk(params_.at(name).t.numel);
    shard_ = mem_.allocate(elements * ew_,
                           mem_.label("gradient shard", Category::gradients,
                                      fmt::format("this rank's reduced gradients: ceil(n / {}) of each parameter's n "
                                                  "elements × {} B",
                                                  s_.world, ew_)));
  }
  if (reduces_in_backward()) {
    for (size_t i = 0; i < order_.size(); ++i) {
      params_.at(order_[i]).t.slot->on_accumulated = [this, i] { gradient_ready(i); };
    }
  }
  if (fully_sharded()) {
    const int slice_lbl =
        mem_.label("weight slices", Category::weights,
                   fmt::format("this rank's slice of each parameter: ceil(n / {}) elements × {} B", s_.world, ew_));
    gathered_lbl_ = mem_.label("gathered weights", Category::weights,
                               "parameters all-gathered while in use: the embeddings and head, and one layer");
    const std::vector<int> units = shapes_->parameter_units();
    const std::vector<NamedTensor>& named = shapes_->parameters();
    for (const auto& name : order_) {
      const int64_t n = params_.at(name).t.numel;
      slices_.push_back(mem_.allocate(std::min(chunk(n), n) * ew_, slice_lbl));
      for (size_t k = 0; k < named.size(); ++k) {
        if (named[k].name == name) units_.push_back(units[k]);
      }
    }
    unit_params_.resize(static_cast<size_t>(1 + *std::max_element(units_.begin(), units_.end())));
    for (size_t i = 0; i < order_.size(); ++i) unit_params_[static_cast<size_t>(units_[i])].push_back(i);
    gathered_.resize(unit_params_.size());
    arrived_.assign(unit_params_.size(), 0);
  }
}

// torch.optim's update where it allocates and headroom's does not (the rest is in place in both):
// Adam and AdamW compute the denominator as exp_avg_sq.sqrt() / bias_correction, Adagrad as
// state_sum.sqrt(), each a new tensor. Single-tensor (torch's default on cpu): parameter by
// parameter, the square root and the quotient exist together, while the previous parameter's
// denominator is still bound to its Python name; foreach (the default on cuda): the square roots of
// every parameter's state at once (Adagrad: and the scaled gradients). Not modelled: the gradient
// copy that non-decoupled weight decay makes (Adam, Adagrad, SGD with weight_decay > 0; off by
// default), and torch's own Adafactor (headroom's is predicted).
void StepSim::torch_update_temporaries() {
  const bool adam = is_adam_family(s_.optimizer);
  if (!adam && s_.optimizer != OptimizerKind::adagrad) return;  // sgd, momentum: in place; adafactor: headroom's
  const int lbl = mem_.label(
      "torch.optim denominators", Category::temporaries,
      s_.cuda ? "foreach: sqrt of every parameter's state at once, parameters × " + std::to_string(ew_) + " B"
              : "single-tensor: sqrt(state) and its quotient for one parameter, and the "
                "previous parameter's denominator");
  auto bytes = [&](const std::string& name) {
    const int64_t n = params_.at(name).t.numel;
    return (sharded() ? std::min(chunk(n), n) : n) * ew_;
  };
  if (s_.cuda) {
    std::vector<Ref> roots, numerators;
    for (const auto& name : order_) roots.push_back(mem_.allocate(bytes(name), lbl));
    // Adagrad's foreach update also scales every gradient into a new tensor while the roots live.
    if (!adam) {
      for (const auto& name : order_) numerators.push_back(mem_.allocate(bytes(name), lbl));
    }
    return;
  }
  Ref denominator;
  for (const auto& name : order_) {
    Ref root = mem_.allocate(bytes(name), lbl);
    if (adam) {
      Ref quotient = mem_.allocate(bytes(name), lbl);
      root.reset();
      denominator = std::move(quotient);  // the previous one goes as the name is rebound
    } else {
      denominator = std::move(root);
    }
  }
}

Estimate StepSim::run() {
  setup();
  // Optimizer state, made when the optimizer is constructed (before the first step).
  std::string formula;
  const std::string per = fmt::format("{} B", ew_);
  switch (s_.optimizer) {
    case OptimizerKind::sgd: formula = "none"; break;
    case OptimizerKind::momentum: formula = "momentum buffer: parameters × " + per; break;
    case OptimizerKind::adam:
    case OptimizerKind::adamw:
      formula = "two moments: 2 × parameters × " + per + ", and a step counter per tensor";
      break;
    case OptimizerKind::adagrad:
      formula = "sum of squares: parameters × " + per + ", and a step counter per tensor";
      break;
    case OptimizerKind::adafactor:
      formula = "float32 row and column second moments per matrix, full ones per vector, step counters";
      break;
  }
  if (sharded() && s_.optimizer != OptimizerKind::sgd) {
    formula += fmt::format(", of this rank's slices (ceil(n / {}) elements of each parameter)", s_.world);
  }
  const int st = mem_.label("optimizer state", Category::optimizer, formula);
  const int working =
      mem_.label("optimizer working memory", Category::optimizer,
                 "scratch the optimizer keeps between steps (adafactor: float32, the largest parameter or the "
                 "rows its slice touches, and each matrix's row and column sums)");
  // The trainer's own optimizer class, built over the meta-device parameters: its state tensors
  // are what the trainer allocates, tensor by tensor, and nothing is allocated here.
  std::vector<Ref> state;
  {
    // Sharded: rank 0's slices of each parameter (the first ceil(n / N) elements), as the trainer's
    // DataParallel hands them to the optimizer.
    std::vector<NamedTensor> owned = shapes_->parameters();
    OptimizerOptions options;
    if (sharded()) {
      options.sharding.emplace();
      for (auto& t : owned) {
        const int64_t n = t.tensor.numel();
        options.sharding->parameters.push_back({t.name, t.tensor.sizes().vec(), 0, std::min(chunk(n), n)});
        t.tensor = t.tensor.view(-1).narrow(0, 0, std::min(chunk(n), n));
      }
    }
    const std::unique_ptr<Optimizer> real = make_optimizer(s_.optimizer, owned, options);
    for (const NamedTensor& t : real->state())
      state.push_back(mem_.allocate(static_cast<int64_t>(t.tensor.nbytes()), st));
    for (const at::Tensor& t : real->working_memory()) {
      state.push_back(mem_.allocate(static_cast<int64_t>(t.nbytes()), working));
    }
  }

  if (s_.cuda) {
    // cuBLAS takes its workspace from the caching allocator at the first matmul and keeps it:
    // 4096 KiB x 8 on sm90 and newer (PyTorch's default CUBLAS_WORKSPACE_CONFIG there; cuBLASLt
    // shares it). Made here, before the step, so that a replayed second step does not make another.
    workspace_ = mem_.allocate(kCublasWorkspaceBytes,
                               mem_.label("cuBLAS workspace", Category::allocator,
                                          "4096 KiB x 8 (sm90+ default of CUBLAS_WORKSPACE_CONFIG), from the "
                                          "caching allocator at the first matmul; 8.1 MiB on older GPUs"));
  }
  const size_t step_begin = mem_.events().size();
  micro_batch(s_.batch);
  if (s_.accum > 1) micro_batch(s_.batch);  // the second sees the first's gradients

  mem_.set_phase(Phase::optimizer);
  std::array<int64_t, sim::kCategories> at_update{};
  for (size_t i = 0; i < mem_.labels().size(); ++i) {
    at_update[static_cast<size_t>(mem_.labels()[i].category)] += mem_.live_under(static_cast<int>(i));
  }
  if (s_.world > 1) {
    Ref loss_sum = mem_.allocate(8, comm_);  // the global batch's loss, summed over the ranks
    if (s_.shard == ShardLevel::none) allreduce_buckets();
    if (s_.shard == ShardLevel::optimizer) {
      for (size_t k = order_.size(); k-- > 0;) reduce_scatter(k, false);
    }
  }
  {
    const int lbl = mem_.label("optimizer temporaries", Category::temporaries,
                               "gradient-norm partials for clipping, per-matrix factor statistics");
    std::vector<Ref> norms;
    for (size_t i = 0; i < order_.size(); ++i) norms.push_back(mem_.allocate(4, lbl));
    Ref stacked = mem_.allocate(static_cast<int64_t>(order_.size()) * 4, lbl);
    Ref total = mem_.allocate(4, lbl);
    if (s_.precision == Precision::fp16_mixed) Ref found_inf = mem_.allocate(4, lbl);
  }
  if (s_.optimizer_impl == OptimizerImpl::torch) torch_update_temporaries();
  if (s_.optimizer == OptimizerKind::adafactor && ew_ != 4 && !s_.cuda) {
    // Adafactor works in its scratch and statistics buffers (working memory). 2-byte parameters on
    // the CPU: the update's in-place ops mix the float32 scratch with the bf16 gradient and parameter,
    // and the CPU kernels cast to float32 copies first — the parameter's update
    // (param += update · -alpha) holds two of its part's size at once.
    const int lbl = mem_.label("optimizer temporaries", Category::temporaries);
    for (const auto& name : order_) {
      const int64_t n = params_.at(name).t.numel, part = sharded() ? std::min(chunk(n), n) : n;
      Ref upcast = mem_.allocate(part * 4, lbl), result = mem_.allocate(part * 4, lbl);
    }
  }
  if (sharded() && !fully_sharded()) gather_parameters();
  mem_.set_phase(Phase::zero_grad);
  for (auto& [name, prm] : params_) prm.t.slot->grad.reset();

  Estimate e;
  e.cuda = s_.cuda;
  e.model = c_.name;
  e.params = count_parameters(c_);
  const auto& peak = mem_.peak();
  e.peak_bytes = peak.bytes;
  e.peak_phase = peak.phase;
  e.phase_peaks = mem_.phase_peaks();
  e.at_update = at_update;
  const auto& labels = mem_.labels();
  for (size_t i = 0; i < labels.size(); ++i) {
    const int64_t bytes = i < peak.by_label.size() ? peak.by_label[i] : 0;
    e.breakdown[static_cast<size_t>(labels[i].category)] += bytes;
    if (bytes > 0) e.items.push_back({labels[i].name, labels[i].category, bytes, labels[i].formula});
  }
  std::stable_sort(e.items.begin(), e.items.end(),
                   [](const EstimateItem& a, const EstimateItem& b) { return a.bytes > b.bytes; });
  // Two steps, as the cache reaches its steady state in the second (the first's free blocks are
  // what the second finds).
  if (s_.caching) e.reserved = replay_reserved(mem_.events(), step_begin, 2, *s_.caching, s_.budget);
  return e;
}

}  // namespace

int64_t Estimate::step_memory() const {
  return peak_bytes - category(sim::Category::weights) - category(sim::Category::gradients) -
         category(sim::Category::optimizer) - category(sim::Category::other);
}

nlohmann::json Estimate::to_json() const {
  nlohmann::json j;
  j["model"] = {{"name", model}, {"params", params}};
  j["peak_bytes"] = peak_bytes;
  j["peak_phase"] = std::string(phase_name(peak_phase));
  nlohmann::json b = nlohmann::json::object();
  for (int c = 0; c < sim::kCategories; ++c) b[sim::category_name(static_cast<sim::Category>(c))] = breakdown[c];
  j["breakdown"] = b;
  nlohmann::json items_json = nlohmann::json::array();
  for (const auto& i : items) {
    items_json.push_back(
        {{"name", i.name}, {"category", sim::category_name(i.category)}, {"bytes", i.bytes}, {"formula", i.formula}});
  }
  j["items"] = items_json;
  nlohmann::json phases = nlohmann::json::object();
  for (Phase p : kStepPhases) phases[std::string(phase_name(p))] = phase_peaks[static_cast<size_t>(p)];
  j["phases"] = phases;
  if (cuda) {
    // What nvidia-smi shows beyond PyTorch's reserved memory: not predicted, named with its source.
    j["outside_reserved"] = nlohmann::json::array(
        {{{"name", "CUDA context"},
          {"bytes", nullptr},
          {"source", "the driver's per-process context and loaded kernels (lazily, CUDA_MODULE_LOADING=LAZY); "
                     "device- and driver-specific: nvidia-smi's used memory minus torch.cuda.memory_reserved() "
                     "(scripts/gpu-check prints it)"}},
         {{"name", "cuBLAS/cuBLASLt workspaces"},
          {"bytes", 0},
          {"source", "inside reserved: PyTorch allocates them through the caching allocator (the cuBLAS "
                     "workspace item above)"}}});
  }
  if (reserved) {
    j["peak_reserved_bytes"] = reserved->peak_reserved;
    j["reserved"] = {{"peak_reserved_bytes", reserved->peak_reserved},
                     {"peak_allocated_block_bytes", reserved->peak_allocated},
                     {"peak_inactive_split_bytes", reserved->peak_inactive_split},
                     {"segments", reserved->segments},
                     {"out_of_memory_under_budget", reserved->oom}};
  }
  return j;
}

std::string Estimate::table() const {
  std::string out = fmt::format("{:<26} {:>11} {:>6}  {}\n", "at the peak", "bytes", "share", "why this size");
  for (const auto& i : items) {
    out += fmt::format("{:<26} {:>11} {:>5.1f}%  {}\n", i.name, format_bytes(i.bytes),
                       100.0 * static_cast<double>(i.bytes) / static_cast<double>(std::max<int64_t>(peak_bytes, 1)),
                       i.formula);
  }
  out += fmt::format("{:<26} {:>11} {:>6}  in {}\n", "peak", format_bytes(peak_bytes), "100%", phase_name(peak_phase));
  if (cuda) {
    out += fmt::format("{:<26} {:>11} {:>6}  {}\n", "outside reserved", "-", "",
                       "the CUDA context (driver and kernels; device-specific, not predicted): nvidia-smi shows it "
                       "on top of reserved");
  }
  if (reserved && reserved->oom) {
    out += fmt::format("{:<26} {:>11} {:>6}  caching allocator: out of segments under the budget, with this much "
                       "reserved ({} of it free inside split segments at most)\n",
                       "reserved at the failure", format_bytes(reserved->peak_reserved), "",
                       format_bytes(reserved->peak_inactive_split));
  } else if (reserved) {
    out += fmt::format("{:<26} {:>11} {:>6}  caching allocator: segments held, {} above the peak (of which {} free "
                       "inside split segments at most)\n",
                       "peak reserved", format_bytes(reserved->peak_reserved), "",
                       format_bytes(reserved->peak_reserved - peak_bytes), format_bytes(reserved->peak_inactive_split));
  }
  return out;
}

Estimate estimate(const ModelConfig& model, const TrainSpec& spec) {
  if (spec.batch < 1 || spec.accum < 1 || spec.seq < 1) fail("estimate: batch, accum and seq must be at least 1");
  if (spec.seq > model.max_positions) {
    fail("--seq {} exceeds {}'s max_position_embeddings {}", spec.seq, model.name, model.max_positions);
  }
  StepSim sim(model, spec);
  return sim.run();
}

namespace {

int64_t corpus_bytes(const std::string& path) {
  if (path.empty()) return static_cast<int64_t>(embedded_corpus().size());
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) fail("--data '{}': cannot read it ({})", path, ec.message());
  return static_cast<int64_t>(size);
}

}  // namespace

TrainSpec train_spec(const RunConfig& cfg) {
  TrainSpec s;
  s.batch = cfg.batch;
  s.accum = cfg.accum;
  s.seq = cfg.seq;
  s.precision = cfg.precision;
  s.optimizer = cfg.optimizer;
  s.optimizer_impl = cfg.optimizer_impl;
  s.checkpointing = cfg.checkpointing;
  s.attention = cfg.attention;
  s.world = world_size_of(cfg);
  s.shard = cfg.shard;
  // An estimate is for before the GPU is rented: --device cuda needs none here.
  s.cuda = cfg.device.rfind("cuda", 0) == 0 || (cfg.device == "auto" && resolve_device(cfg.device).is_cuda());
  s.dataset_bytes = s.cuda ? 0 : corpus_bytes(cfg.data);
  if (s.cuda || cfg.allocator == AllocatorKind::caching) {
    const std::string settings = cfg.allocator_conf.empty() ? allocator_config_from_environment() : cfg.allocator_conf;
    s.caching = parse_allocator_config(
        settings, cfg.allocator_conf.empty() ? "PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF" : "--allocator-conf");
    s.budget = cfg.memory_budget;
  }
  return s;
}

std::function<int64_t(int64_t)> peak_predictor(const RunConfig& config) {
  const ModelConfig model = load_model_config(config.model, config.overrides);
  TrainSpec spec = train_spec(config);
  spec.accum = 1;
  return [model, spec](int64_t batch) mutable {
    spec.batch = batch;
    return estimate(model, spec).peak_bytes;
  };
}

}  // namespace headroom
