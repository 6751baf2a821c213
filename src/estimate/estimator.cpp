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

struct Param {
  Tensor t;
  int64_t rows = 0, cols = 0;  // cols 0: a vector
};

// One simulated step of the trainer, mirroring CausalLM::forward and train()'s step loop.
class StepSim {
 public:
  StepSim(const ModelConfig& c, const TrainSpec& s) : c_(c), s_(s), graph_(mem_), g_(&graph_) {
    mixed_ = s.precision == Precision::bf16_mixed || s.precision == Precision::fp16_mixed;
    ew_ = s.precision == Precision::bf16 ? 2 : 4;
    const std::string w = fmt::format("{} B each", ew_);
    weights_ = mem_.label("weights", Category::weights, "parameters × " + w);
    grads_ = mem_.label("gradients", Category::gradients, "parameters × " + w + ", filled as backward reaches them");
    copies_ = mem_.label("autocast weight copies", Category::weight_copies,
                         "2-byte copies of the matmul weights, made in forward, kept until their backward");
    tmp_ = g_->temporaries_label();
    if (s.cuda) {
      mem_.set_rounding(512, mem_.label("allocator rounding", Category::allocator,
                                        "the CUDA caching allocator rounds every block up to 512 bytes"));
    }
  }

  Estimate run();

 private:
  // ---- labels ----
  int act(const std::string& name, const std::string& formula) {
    return mem_.label(name, Category::activations, formula);
  }

  // What a backward node remembers of a tensor it does not save: its size and gradient slot.
  static Tensor meta(const Tensor& t) {
    Tensor m = t;
    m.buf = nullptr;
    return m;
  }

  // ---- elementary ops (sizes and what they save, as ATen's CPU kernels and autograd formulas) ----
  Emit grad_to(const Tensor& x) { return x.slot ? Emit{x.slot, mem_.allocate(x.bytes(), tmp_)} : Emit{}; }
  static Emit pass_to(const Tensor& x, const Ref& g) { return Emit{x.slot, g}; }

  Tensor make(int64_t numel, int elem, int label, bool rg = true) { return g_->make(numel, elem, label, rg); }

  // x.to(elem): a copy when the dtype changes; backward casts the gradient back.
  Tensor cast(const Tensor& x, int elem, int label) {
    if (x.elem == elem) return x;
    Tensor out = make(x.numel, elem, label, x.requires_grad());
    g_->record({&out}, {}, [this, x = meta(x)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x)}; });
    return out;
  }

  // What a matmul under autocast reads: a 2-byte copy of a parameter, cached for the autocast scope.
  Tensor weight_in(const Param& p) {
    if (!mixed_) return p.t;
    auto it = cache_->find(&p);
    if (it != cache_->end()) return it->second;
    Tensor copy = cast(p.t, 2, copies_);
    cache_->emplace(&p, copy);
    return copy;
  }

  Tensor linear(const Tensor& x, const Param& w, const Param* b, int label) {
    const int64_t rows = x.numel / w.cols;
    Tensor xi = mixed_ ? cast(x, 2, act("autocast activation copies", "2-byte copies of float32 matmul inputs")) : x;
    Tensor wi = weight_in(w);
    Tensor bi = b ? weight_in(*b) : Tensor{};
    Tensor out = make(rows * w.rows, wi.elem, label);
    g_->record({&out}, {xi.buf, wi.buf},
               [this, xi = meta(xi), wi = meta(wi), bi = meta(bi), b](const std::vector<Ref>&) {
                 // The weight's gradient comes back through the transpose: a view, which an input
                 // buffer cannot add into in place (it matters for a weight used twice: a tied head).
                 Emit w = grad_to(wi);
                 w.view = true;
                 std::vector<Emit> e{grad_to(xi), w};
                 if (b) e.push_back(grad_to(bi));
                 return e;
               });
    return out;
  }

  // a + b (b may broadcast): the sum in the wider dtype; backward passes the gradient through,
  // converting or reducing it where an input differs.
  Tensor add(const Tensor& a, const Tensor& b, int label) {
    Tensor out = make(std::max(a.numel, b.numel), std::max(a.elem, b.elem), label, a.slot || b.slot);
    g_->record({&out}, {}, [this, a = meta(a), b = meta(b), out = meta(out)](const std::vector<Ref>& in) {
      std::vector<Emit> e;
      for (const Tensor* x : {&a, &b}) {
        if (!x->slot) continue;
        e.push_back(x->numel == out.numel && x->elem == out.elem ? pass_to(*x, in[0]) : grad_to(*x));
      }
      return e;
    });
    return out;
  }

  // a * b, b possibly a broadcast weight or a constant: saves each for the other's gradient; a
  // broadcast operand's gradient is reduced from a full-size product.
  Tensor mul(const Tensor& a, const Tensor& b, int label) {
    Tensor out = make(std::max(a.numel, b.numel), std::max(a.elem, b.elem), label, a.slot || b.slot);
    std::vector<Ref> saved;
    if (b.slot) saved.push_back(a.buf);
    if (a.slot) saved.push_back(b.buf);
    g_->record({&out}, std::move(saved), [this, a = meta(a), b = meta(b), out = meta(out)](const std::vector<Ref>&) {
      std::vector<Emit> e;
      for (const Tensor* x : {&a, &b}) {
        if (!x->slot) continue;
        Ref full = x->numel < out.numel ? g_->scratch(out.bytes()) : nullptr;
        e.push_back(grad_to(*x));
      }
      return e;
    });
    return out;
  }

  // x * python scalar: nothing saved.
  Tensor scale(const Tensor& x, int label) {
    Tensor out = make(x.numel, x.elem, label, x.requires_grad());
    g_->record({&out}, {}, [this, x = meta(x)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x)}; });
    return out;
  }

  // A view with its own gradient slot whose gradient is passed through unchanged (view, transpose).
  Tensor view(const Tensor& x) {
    Tensor v = g_->alias(x, x.numel);
    g_->record({&v}, {}, [x = meta(x)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(x, in[0])}; });
    return v;
  }

  // A narrow/chunk view: its backward writes into a zero-filled gradient of the whole input.
  Tensor slice(const Tensor& x, int64_t numel) {
    Tensor v = g_->alias(x, numel);
    g_->record({&v}, {}, [this, x = meta(x)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x)}; });
    return v;
  }

  // ATen's rms_norm: in float32 whatever the input (a 2-byte input is upcast first and the result
  // cast back): pow → mean → + eps → rsqrt → x · r → · weight.
  Tensor rms_norm(const Tensor& in, const Param& w) {
    const int64_t rows = in.numel / c_.hidden_size;
    const int lbl =
        act("norm activations", "per norm: float32 input and normalised input, B·T·hidden each, and the output");
    Tensor x = cast(in, 4, lbl);
    Tensor sq = make(x.numel, x.elem, tmp_, x.requires_grad());
    g_->record({&sq}, {x.buf}, [this, x = meta(x)](const std::vector<Ref>&) {
      Ref a = g_->scratch(x.bytes()), b = g_->scratch(x.bytes());
      return std::vector<Emit>{grad_to(x)};
    });
    Tensor mean = make(rows, x.elem, tmp_, x.requires_grad());
    g_->record({&mean}, {}, [this, sq = meta(sq)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(sq)}; });
    sq = Tensor{};
    Tensor r = make(rows, x.elem, lbl, x.requires_grad());  // rsqrt(mean + eps); the add is in place
    g_->record({&r}, {r.buf},
               [this, mean = meta(mean)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(mean)}; });
    mean = Tensor{};
    Tensor xn = mul(x, r, lbl);
    x = r = Tensor{};
    return cast(mul(xn, w.t, lbl), in.elem, lbl);
  }

  Tensor layer_norm(const Tensor& x, const Param& w, const Param* b) {
    const int64_t rows = x.numel / c_.hidden_size;
    const int lbl = act("norm activations", "normalised output per norm, B·T·hidden, and mean and rstd per row");
    Tensor out = make(x.numel, x.elem, lbl);
    Ref mean = mem_.allocate(rows * x.elem, lbl), rstd = mem_.allocate(rows * x.elem, lbl);
    g_->record({&out}, {x.buf, mean, rstd}, [this, x = meta(x), w, b](const std::vector<Ref>&) {
      std::vector<Emit> e{grad_to(x), grad_to(w.t)};
      if (b) e.push_back(grad_to(b->t));
      return e;
    });
    return out;
  }

  Tensor norm(const Tensor& x, const Param& w, const Param* b) {
    return c_.norm == NormKind::layer_norm ? layer_norm(x, w, b) : rms_norm(x, w);
  }

  Tensor activation(const Tensor& x) {
    const int lbl = act("MLP activations", "up/gate projections and activation outputs, B·T·intermediate each");
    Tensor out = make(x.numel, x.elem, lbl);
    const bool saves_result = c_.activation == Activation::relu;
    g_->record({&out}, {saves_result ? out.buf : x.buf},
               [this, x = meta(x)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x)}; });
    return out;
  }

  // CPU dropout: input * (bernoulli mask / (1 - p)); the mask, in the input's dtype, is saved.
  Tensor dropout(const Tensor& x, double p, int label) {
    if (p <= 0) return x;
    Tensor mask = make(x.numel, x.elem, act("dropout masks", "one mask per dropout, in the activation dtype"), false);
    return mul(x, mask, label);
  }

  Tensor rotary(const Tensor& x, int64_t heads, const Tensor& cos, const Tensor& sin) {
    const int64_t rows = x.numel / (heads * c_.head_dim);
    const int64_t rd = c_.rotary_dim, half = rd / 2;
    const bool partial = rd != c_.head_dim;
    const int lbl = act("attention q, k, v", "queries, keys and values after rotary, as attention saves them");
    Tensor rot = partial ? slice(x, rows * heads * rd) : x;
    Tensor hi = slice(rot, rows * heads * half);
    Tensor neg = make(hi.numel, x.elem, tmp_, hi.requires_grad());
    g_->record({&neg}, {}, [this, hi = meta(hi)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(hi)}; });
    Tensor lo = slice(rot, rows * heads * half);
    Tensor rh = make(rot.numel, x.elem, tmp_, true);
    g_->record({&rh}, {}, [neg = meta(neg), lo = meta(lo)](const std::vector<Ref>& in) {
      return std::vector<Emit>{pass_to(neg, in[0]), pass_to(lo, in[0])};
    });
    neg = Tensor{};
    const int table_lbl = act("rotary tables", "cos and sin, seq × rotary_dim");
    Tensor c = cast(cos, x.elem, table_lbl), s = cast(sin, x.elem, table_lbl);
    Tensor out = add(mul(rot, c, tmp_), mul(rh, s, tmp_), lbl);
    if (!partial) return out;
    Tensor pass = slice(x, rows * heads * (c_.head_dim - rd));
    Tensor joined = make(x.numel, x.elem, lbl);
    g_->record({&joined}, {}, [out = meta(out), pass = meta(pass)](const std::vector<Ref>& in) {
      return std::vector<Emit>{pass_to(out, in[0]), pass_to(pass, in[0])};
    });
    return joined;
  }

  Tensor attention_block(int64_t layer, const Tensor& x, const Tensor& cos, const Tensor& sin);
  Tensor mlp_block(int64_t layer, const Tensor& x);
  Tensor block(int64_t layer, const Tensor& x, const Tensor& cos, const Tensor& sin, bool inner_checkpoint);
  Tensor checkpointed(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x);
  Tensor forward(int64_t rows);
  void micro_batch(int64_t rows);
  void setup();
  void optimizer_phase();

  const Param& p(const std::string& name) const {
    auto it = params_.find(name);
    if (it == params_.end()) fail("estimator: the model has no parameter '{}'", name);
    return it->second;
  }
  const Param* maybe(const std::string& name) const {
    auto it = params_.find(name);
    return it == params_.end() ? nullptr : &it->second;
  }

  const ModelConfig& c_;
  const TrainSpec& s_;
  sim::Memory mem_;
  sim::Graph graph_;
  sim::Graph* g_;
  bool mixed_ = false;
  int ew_ = 4;  // parameter bytes
  int weights_, grads_, copies_, tmp_;
  std::map<std::string, Param> params_;
  std::vector<std::string> order_;  // parameter names in registration order
  std::map<const Param*, Tensor>* cache_ = nullptr;
  Ref dataset_;
  std::unique_ptr<CausalLM> shapes_;  // the model on the meta device
};

Tensor StepSim::attention_block(int64_t layer, const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const std::string pre = fmt::format("layers.{}.attn.", layer);
  const int64_t tokens = x.numel / c_.hidden_size;
  const int64_t t = s_.seq, b = tokens / t;
  const int64_t qw = c_.num_heads * c_.head_dim, kw = c_.num_kv_heads * c_.head_dim;
  const int qkv_lbl =
      act("attention q, k, v", "queries, keys and values (after rotary), B·T·(heads + 2·kv_heads)·head_dim");
  const int out_lbl = act("attention outputs", "attention output B·T·heads·head_dim, and its float32 log-sum-exp");
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
  if (!c_.learned_positions) {
    q = rotary(q, c_.num_heads, cos, sin);
    k = rotary(k, c_.num_kv_heads, cos, sin);
  }
  const bool windowed = layer >= c_.window_from_layer && c_.sliding_window && *c_.sliding_window < t;
  const double dropout_p = c_.attn_dropout;
  const int64_t scores = b * c_.num_heads * t * t;
  const int e = q.elem;
  Tensor y;
  const int mask_lbl = act("attention masks", "boolean seq × seq masks");
  auto blocked_mask = [&](bool window) {
    Ref pos = mem_.allocate(t * 8, tmp_);
    Ref diff = mem_.allocate(t * t * 8, tmp_);
    Ref blocked = mem_.allocate(t * t, tmp_);
    if (window) {
      Ref far = mem_.allocate(t * t, tmp_);
      blocked = mem_.allocate(t * t, tmp_);
    }
    return blocked;
  };
  if (s_.attention == AttentionPath::flash && dropout_p <= 0) {
    Ref mask;
    if (windowed) {
      Ref blocked = blocked_mask(true);
      mask = mem_.allocate(t * t, mask_lbl);
    }
    y = make(tokens * qw, e, out_lbl);
    Ref lse = mem_.allocate(b * c_.num_heads * t * 4, out_lbl);
    std::vector<Ref> saved{q.buf, k.buf, v.buf, y.buf, lse};
    if (mask) saved.push_back(mask);
    g_->record({&y}, saved, [this, q = meta(q), k = meta(k), v = meta(v)](const std::vector<Ref>&) {
      return std::vector<Emit>{grad_to(q), grad_to(k), grad_to(v)};
    });
    // The CPU kernel writes its output in the query's layout: [B, T, heads, hd] for a transposed
    // projection, where transpose + reshape is a view; partial rotary's cat makes the query a
    // contiguous [B, heads, T, hd], and then the reshape copies.
    if (c_.rotary_dim != c_.head_dim && !c_.learned_positions) {
      Tensor copy = make(y.numel, e, out_lbl);
      g_->record({&copy}, {},
                 [y = meta(y)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(y, in[0])}; });
      y = copy;
    }
  } else if (s_.attention == AttentionPath::flash) {
    // With dropout the CPU runs ATen's math attention: q and k scaled by sqrt(scale), copied to
    // contiguous batches when B > 1 (as is v), q·kᵀ, + the causal mask, softmax, dropout, p·v; the
    // output comes back as [B, heads, T, hd], so transpose + reshape copies it.
    // It computes in float32: 2-byte q, k and v are upcast first and the output cast back.
    const int lbl = act("attention scores", "B·heads·seq² per matrix kept: softmax, dropout mask and output");
    const int ce = 4;
    auto batched = [&](const Tensor& x) {
      if (b == 1) return x;
      Tensor c = make(x.numel, ce, qkv_lbl);
      g_->record({&c}, {}, [x = meta(x)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(x, in[0])}; });
      return c;
    };
    Tensor q32 = cast(q, ce, qkv_lbl), k32 = cast(k, ce, qkv_lbl), v32 = cast(v, ce, qkv_lbl);
    Tensor qs = batched(scale(q32, qkv_lbl)), ks = batched(scale(k32, qkv_lbl)), vc = batched(v32);
    q32 = k32 = v32 = Tensor{};
    Tensor raw = make(scores, ce, lbl);
    g_->record({&raw}, {qs.buf, ks.buf}, [this, qs = meta(qs), ks = meta(ks)](const std::vector<Ref>&) {
      return std::vector<Emit>{grad_to(qs), grad_to(ks)};
    });
    qs = ks = Tensor{};
    Ref causal = mem_.allocate(t * t * ce, tmp_);
    Tensor masked = view(raw);  // + the mask, in place
    raw = Tensor{};
    Tensor probs = make(scores, ce, lbl);
    g_->record({&probs}, {probs.buf},
               [this, masked = meta(masked)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(masked)}; });
    masked = Tensor{};
    causal.reset();
    probs = dropout(probs, dropout_p, lbl);
    Tensor heads_out = make(tokens * qw, ce, tmp_);
    g_->record({&heads_out}, {probs.buf, vc.buf}, [this, probs = meta(probs), vc = meta(vc)](const std::vector<Ref>&) {
      return std::vector<Emit>{grad_to(probs), grad_to(vc)};
    });
    probs = vc = Tensor{};
    heads_out = cast(heads_out, e, tmp_);
    y = make(tokens * qw, e, out_lbl);
    g_->record({&y}, {}, [heads_out = meta(heads_out)](const std::vector<Ref>& in) {
      return std::vector<Emit>{pass_to(heads_out, in[0])};
    });
  } else {
    // The explicit path (model/attention.cpp): q·kᵀ, scale, mask, float32 softmax, cast, p·v.
    const int lbl = act("attention scores", "B·heads·seq² score and probability matrices kept for backward");
    const int64_t groups = c_.num_heads / c_.num_kv_heads;
    Tensor kk = k, vv = v;
    if (groups > 1) {
      kk = make(tokens * qw, e, qkv_lbl);
      g_->record({&kk}, {}, [this, k = meta(k)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(k)}; });
      vv = make(tokens * qw, e, qkv_lbl);
      g_->record({&vv}, {}, [this, v = meta(v)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(v)}; });
    }
    // matmul folds [B, heads] into one batch dimension: transposed views are copied first.
    Tensor qc = make(q.numel, e, qkv_lbl);
    g_->record({&qc}, {}, [q = meta(q)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(q, in[0])}; });
    Tensor kc = make(kk.numel, e, qkv_lbl);
    g_->record({&kc}, {},
               [kk = meta(kk)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(kk, in[0])}; });
    Tensor raw = make(scores, e, lbl);
    g_->record({&raw}, {qc.buf, kc.buf}, [this, qc = meta(qc), kc = meta(kc)](const std::vector<Ref>&) {
      return std::vector<Emit>{grad_to(qc), grad_to(kc)};
    });
    qc = kc = kk = Tensor{};
    Tensor scaled = scale(raw, lbl);
    raw = Tensor{};
    Ref blocked = blocked_mask(windowed);
    Ref mask = mem_.allocate(t * t, mask_lbl);
    blocked.reset();
    Tensor masked = make(scores, e, lbl);
    g_->record({&masked}, {mask},
               [this, scaled = meta(scaled)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(scaled)}; });
    scaled = Tensor{};
    Tensor in32 = cast(masked, 4, lbl);
    masked = Tensor{};
    Tensor probs32 = make(scores, 4, lbl);
    g_->record({&probs32}, {probs32.buf},
               [this, in32 = meta(in32)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(in32)}; });
    in32 = Tensor{};
    Tensor probs = cast(probs32, e, lbl);
    probs32 = Tensor{};
    if (dropout_p > 0) probs = dropout(probs, dropout_p, lbl);
    Tensor vc = vv;
    if (groups == 1) {
      vc = make(vv.numel, e, qkv_lbl);
      g_->record({&vc}, {},
                 [vv = meta(vv)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(vv, in[0])}; });
    }
    Tensor heads_out = make(tokens * qw, e, tmp_);
    g_->record({&heads_out}, {probs.buf, vc.buf}, [this, probs = meta(probs), vc = meta(vc)](const std::vector<Ref>&) {
      return std::vector<Emit>{grad_to(probs), grad_to(vc)};
    });
    // transpose(1, 2).reshape: a copy into [B, T, heads·head_dim].
    y = make(tokens * qw, e, out_lbl);
    g_->record({&y}, {}, [heads_out = meta(heads_out)](const std::vector<Ref>& in) {
      return std::vector<Emit>{pass_to(heads_out, in[0])};
    });
  }
  q = k = v = Tensor{};
  const int res_lbl = act("residual stream", "block outputs and residual sums, B·T·hidden each");
  Tensor o = linear(y, p(pre + "o_proj.weight"), maybe(pre + "o_proj.bias"), res_lbl);
  return dropout(o, c_.resid_dropout, res_lbl);
}

Tensor StepSim::mlp_block(int64_t layer, const Tensor& x) {
  const std::string pre = fmt::format("layers.{}.mlp.", layer);
  const int lbl = act("MLP activations", "up/gate projections and activation outputs, B·T·intermediate each");
  Tensor h;
  if (c_.gated_mlp) {
    Tensor gate = activation(linear(x, p(pre + "gate_proj.weight"), maybe(pre + "gate_proj.bias"), lbl));
    Tensor up = linear(x, p(pre + "up_proj.weight"), maybe(pre + "up_proj.bias"), lbl);
    h = mul(gate, up, lbl);
  } else {
    h = activation(linear(x, p(pre + "up_proj.weight"), maybe(pre + "up_proj.bias"), lbl));
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
  Tensor x = make(tokens * h, ew_, res_lbl);
  g_->record({&x}, {}, [this, &embed](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(embed.t)}; });
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
    if (s_.checkpointing.whole_layer(i) && g_->grad_mode()) {
      x = checkpointed([this, i, cos, sin](const Tensor& in) { return block(i, in, cos, sin, false); }, x);
    } else {
      x = block(i, x, cos, sin, s_.checkpointing.attention_only());
    }
  }
  x = norm(x, p("final_norm.weight"), maybe("final_norm.bias"));
  const int logits_lbl = mem_.label("logits", Category::logits, "B·T·vocab in the matmul dtype");
  return linear(x, c_.tie_word_embeddings ? embed : p("lm_head.weight"), nullptr, logits_lbl);
}

void StepSim::micro_batch(int64_t rows) {
  const int64_t t = s_.seq, tokens = rows * t, vocab = c_.vocab_size;
  const int batch_lbl = mem_.label("batch", Category::other, "token ids, B·(T+1) int64, and the targets' copy");
  const int loss_lbl = mem_.label("loss buffers", Category::loss,
                                  "float32 log-softmax kept for backward, B·T·vocab × 4, and its gradient");
  mem_.set_phase(Phase::data);
  Ref batch = mem_.allocate(rows * (t + 1) * 8, batch_lbl);
  Tensor loss;
  {
    mem_.set_phase(Phase::forward);
    std::map<const Param*, Tensor> cache;
    cache_ = &cache;
    Tensor logits = forward(rows);
    // token_loss: logits.to(float32), then cross_entropy = nll_loss(log_softmax(x)).
    Tensor x32 = cast(logits, 4, mem_.label("logits", Category::logits));
    Ref targets = mem_.allocate(tokens * 8, batch_lbl);
    Tensor lsm = make(tokens * vocab, 4, loss_lbl);
    g_->record({&lsm}, {lsm.buf},
               [this, x32 = meta(x32)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x32)}; });
    x32 = logits = Tensor{};
    loss = make(1, 4, loss_lbl);
    Ref total_weight = mem_.allocate(4, loss_lbl);
    g_->record({&loss}, {targets, total_weight},
               [this, lsm = meta(lsm)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(lsm)}; });
    lsm = Tensor{};
    cache.clear();
    cache_ = nullptr;
  }
  mem_.set_phase(Phase::backward);
  Tensor root = scale(loss, tmp_);
  if (s_.precision == Precision::fp16_mixed) root = scale(root, tmp_);
  loss = Tensor{};
  g_->backward(root);
}

void StepSim::setup() {
  if (!s_.cuda && s_.dataset_bytes > 0) {
    dataset_ = mem_.allocate(s_.dataset_bytes,
                             mem_.label("dataset", Category::other, "the corpus in host memory, 1 B per token"));
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
    prm.t.buf = mem_.allocate(prm.t.numel * ew_, weights_);
    prm.t.slot = std::make_shared<sim::GradSlot>();
    prm.t.slot->numel = prm.t.numel;
    prm.t.slot->elem = ew_;
    prm.t.slot->param_label = grads_;
    params_.emplace(np.name, prm);
    order_.push_back(np.name);
  }
  // A tied head is the embedding used a second time: two gradients arrive for it per backward.
  if (c_.tie_word_embeddings) params_.at("embed_tokens.weight").t.slot->uses = 2;
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
  const int st = mem_.label("optimizer state", Category::optimizer, formula);
  const int working =
      mem_.label("optimizer working memory", Category::optimizer,
                 "scratch the optimizer keeps between steps (adafactor: float32, the largest parameter)");
  // The trainer's own optimizer class, built over the meta-device parameters: its state tensors
  // are what the trainer allocates, tensor by tensor, and nothing is allocated here.
  std::vector<Ref> state;
  {
    const std::unique_ptr<Optimizer> real = make_optimizer(s_.optimizer, shapes_->parameters(), OptimizerOptions{});
    for (const NamedTensor& t : real->state())
      state.push_back(mem_.allocate(static_cast<int64_t>(t.tensor.nbytes()), st));
    for (const at::Tensor& t : real->working_memory()) {
      state.push_back(mem_.allocate(static_cast<int64_t>(t.nbytes()), working));
    }
  }

  micro_batch(s_.batch);
  if (s_.accum > 1) micro_batch(s_.batch);  // the second sees the first's gradients

  mem_.set_phase(Phase::optimizer);
  std::array<int64_t, sim::kCategories> at_update{};
  for (size_t i = 0; i < mem_.labels().size(); ++i) {
    at_update[static_cast<size_t>(mem_.labels()[i].category)] += mem_.live_under(static_cast<int>(i));
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
  if (s_.optimizer == OptimizerKind::adafactor) {
    const int lbl = mem_.label("optimizer temporaries", Category::temporaries);
    for (const auto& name : order_) {
      const Param& prm = params_.at(name);
      if (prm.cols > 0) Ref rows = mem_.allocate(prm.rows * 4, lbl), cols = mem_.allocate(prm.cols * 4, lbl);
      // 2-byte parameters on the CPU: the update's in-place ops mix the float32 moments with the
      // bf16 gradient and parameter, and the CPU kernels cast to float32 copies first — the
      // parameter's update (param += update · -alpha) holds two of its size at once.
      if (ew_ != 4 && !s_.cuda) {
        Ref upcast = mem_.allocate(prm.t.numel * 4, lbl), result = mem_.allocate(prm.t.numel * 4, lbl);
      }
    }
  }
  mem_.set_phase(Phase::zero_grad);
  for (auto& [name, prm] : params_) prm.t.slot->grad.reset();

  Estimate e;
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
  s.checkpointing = cfg.checkpointing;
  s.attention = cfg.attention;
  // An estimate is for before the GPU is rented: --device cuda needs none here.
  s.cuda = cfg.device.rfind("cuda", 0) == 0 || (cfg.device == "auto" && resolve_device(cfg.device).is_cuda());
  s.dataset_bytes = s.cuda ? 0 : corpus_bytes(cfg.data);
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
