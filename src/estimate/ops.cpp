#include "estimate/ops.h"

#include <algorithm>

#include "config/checkpoint_policy.h"
#include "device/attention_kernel_adapter.h"

namespace headroom::sim {

Tensor Ops::cast(const Tensor& x, int elem, int label) {
  if (x.elem == elem) return x;
  Tensor out = make(x.numel, elem, label, x.requires_grad());
  g_->record({&out}, {}, [this, x = meta(x)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x)}; });
  return out;
}

Tensor Ops::weight_in(const Param& p) {
  if (!mixed_) return p.t;
  if (!p.t.requires_grad()) return cast(p.t, 2, copies_);
  auto it = cache_->find(&p);
  if (it != cache_->end()) return it->second;
  Tensor copy = cast(p.t, 2, copies_);
  cache_->emplace(&p, copy);
  return copy;
}

Tensor Ops::linear(const Tensor& x, const Param& w, const Param* b, int label) {
  const int64_t rows = x.numel / w.cols;
  Tensor xi = mixed_ ? cast(x, 2, act("autocast activation copies", "2-byte copies of float32 matmul inputs")) : x;
  Tensor wi = weight_in(w);
  Tensor bi = b ? weight_in(*b) : Tensor{};
  const bool weights_grad = wi.requires_grad() || bi.requires_grad();
  // Without a bias it is aten::mm, which per-op checkpointing counts.
  const bool keep = b == nullptr && kept_ && CheckpointPolicy::keeps_matmul(++kept_->matmuls);
  const int64_t numel = rows * w.rows;
  Tensor out = g_->adopt(output_buffer(numel * wi.elem, label, keep), numel, wi.elem,
                         xi.requires_grad() || weights_grad);
  std::vector<Ref> saved;
  if (wi.requires_grad()) saved.push_back(xi.buf);
  if (xi.requires_grad()) saved.push_back(wi.buf);
  g_->record({&out}, std::move(saved), [this, xi = meta(xi), wi = meta(wi), bi = meta(bi), b](const std::vector<Ref>&) {
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

Tensor Ops::nf4_linear(const Tensor& x, int64_t out, int64_t in, int elem, const Param* b, int label) {
  const int64_t rows = x.numel / in;
  const int dense = mem_.label("NF4 dequantised weights", Category::temporaries,
                               "--base-weights nf4: one projection's weight, out × in in the compute dtype, while it "
                               "runs (forward and backward)");
  Ref w = mem_.allocate(out * in * elem, dense);
  Ref xi, bi;
  if (mixed_ && x.elem != 2) xi = mem_.allocate(x.numel * 2, act("autocast activation copies", "2-byte copies of float32 matmul inputs"));
  if (b && mixed_ && b->t.elem != 2) bi = mem_.allocate(b->t.numel * 2, copies_);
  Tensor y = make(rows * out, elem, label, x.requires_grad());
  xi.reset();
  bi.reset();
  w.reset();
  g_->record({&y}, {}, [this, x = meta(x), out, in, elem, rows, dense](const std::vector<Ref>&) {
    Ref again = mem_.allocate(out * in * elem, dense);
    if (x.elem == elem) {
      Emit e = grad_to(x);
      again.reset();
      return std::vector<Emit>{e};
    }
    Ref computed = mem_.allocate(rows * in * elem, tmp_);
    again.reset();
    Emit e = grad_to(x);
    computed.reset();
    return std::vector<Emit>{e};
  });
  return y;
}

Tensor Ops::add(const Tensor& a, const Tensor& b, int label) {
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

Tensor Ops::mul(const Tensor& a, const Tensor& b, int label) {
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

Tensor Ops::scale(const Tensor& x, int label) {
  Tensor out = make(x.numel, x.elem, label, x.requires_grad());
  g_->record({&out}, {}, [this, x = meta(x)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x)}; });
  return out;
}

Tensor Ops::view(const Tensor& x) {
  Tensor v = g_->alias(x, x.numel);
  g_->record({&v}, {}, [x = meta(x)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(x, in[0])}; });
  return v;
}

Tensor Ops::slice(const Tensor& x, int64_t numel) {
  Tensor v = g_->alias(x, numel);
  g_->record({&v}, {}, [this, x = meta(x)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x)}; });
  return v;
}

Tensor Ops::rms_norm(const Tensor& in, const Param& w_in, bool plus_one) {
  Param w = w_in;
  if (plus_one) {
    // Gemma: the kernel gets 1 + w, a new vector whose gradient passes back to w.
    w.t = make(w_in.t.numel, w_in.t.elem, tmp_, w_in.t.requires_grad());
    g_->record({&w.t}, {}, [w0 = meta(w_in.t)](const std::vector<Ref>& in) {
      return std::vector<Emit>{pass_to(w0, in[0])};
    });
  }
  const int64_t rows = in.numel / w.t.numel;
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

Tensor Ops::layer_norm(const Tensor& x, const Param& w, const Param* b) {
  const int64_t rows = x.numel / w.t.numel;
  const int lbl = act("norm activations", "normalised output per norm, B·T·hidden, and mean and rstd per row");
  Tensor out = make(x.numel, x.elem, lbl, x.requires_grad() || w.t.requires_grad() || (b && b->t.requires_grad()));
  Ref mean = mem_.allocate(rows * x.elem, lbl), rstd = mem_.allocate(rows * x.elem, lbl);
  g_->record({&out}, {x.buf, mean, rstd}, [this, x = meta(x), w, b](const std::vector<Ref>&) {
    std::vector<Emit> e{grad_to(x), grad_to(w.t)};
    if (b) e.push_back(grad_to(b->t));
    return e;
  });
  return out;
}

Tensor Ops::activation(const Tensor& x, bool saves_result) {
  const int lbl = act("MLP activations", "up/gate projections and activation outputs, B·T·intermediate each");
  Tensor out = make(x.numel, x.elem, lbl, x.requires_grad());
  g_->record({&out}, {saves_result ? out.buf : x.buf},
             [this, x = meta(x)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x)}; });
  return out;
}

Tensor Ops::dropout(const Tensor& x, double p, int label) {
  if (p <= 0) return x;
  Tensor mask = make(x.numel, x.elem, act("dropout masks", "one mask per dropout, in the activation dtype"), false);
  return mul(x, mask, label);
}

Tensor Ops::rotary(const Tensor& x, int64_t heads, int64_t head_dim, int64_t rd, const Tensor& cos, const Tensor& sin) {
  const int64_t rows = x.numel / (heads * head_dim);
  const int64_t half = rd / 2;
  const bool partial = rd != head_dim;
  const int lbl = act("attention q, k, v", "queries, keys and values after rotary, as attention saves them");
  Tensor rot = partial ? slice(x, rows * heads * rd) : x;
  Tensor hi = slice(rot, rows * heads * half);
  Tensor neg = make(hi.numel, x.elem, tmp_, hi.requires_grad());
  g_->record({&neg}, {}, [this, hi = meta(hi)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(hi)}; });
  Tensor lo = slice(rot, rows * heads * half);
  Tensor rh = make(rot.numel, x.elem, tmp_, rot.requires_grad());
  g_->record({&rh}, {}, [neg = meta(neg), lo = meta(lo)](const std::vector<Ref>& in) {
    return std::vector<Emit>{pass_to(neg, in[0]), pass_to(lo, in[0])};
  });
  neg = Tensor{};
  const int table_lbl = act("rotary tables", "cos and sin, seq × rotary_dim");
  Tensor c = cast(cos, x.elem, table_lbl), s = cast(sin, x.elem, table_lbl);
  Tensor out = add(mul(rot, c, tmp_), mul(rh, s, tmp_), lbl);
  if (!partial) return out;
  Tensor pass = slice(x, rows * heads * (head_dim - rd));
  Tensor joined = make(x.numel, x.elem, lbl, x.requires_grad());
  g_->record({&joined}, {}, [out = meta(out), pass = meta(pass)](const std::vector<Ref>& in) {
    return std::vector<Emit>{pass_to(out, in[0]), pass_to(pass, in[0])};
  });
  return joined;
}

Ops::Ops(bool mixed) : graph_(mem_), g_(&graph_), mixed_(mixed) {
  tmp_ = g_->temporaries_label();
  copies_ = mem_.label("autocast weight copies", Category::weight_copies,
                       "2-byte copies of the matmul weights, made in forward, kept until their backward");
}

Ref Ops::output_buffer(int64_t bytes, int label, bool keep) {
  if (!keep || kept_ == nullptr) return mem_.allocate(bytes, label);
  if (kept_->recompute) return std::move(kept_->outputs.at(kept_->next++));
  Ref made = mem_.allocate(bytes, label);
  kept_->outputs.push_back(made);
  return made;
}

Tensor Ops::merge_heads(const Tensor& heads_out, int label) {
  // transpose(1, 2).reshape: a copy into [B, T, heads·head_dim]; its backward reshapes the
  // gradient back, which copies it too.
  Tensor y = make(heads_out.numel, heads_out.elem, label, heads_out.requires_grad());
  g_->record({&y}, {}, [this, heads_out = meta(heads_out)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(heads_out)};
  });
  return y;
}

Ref Ops::blocked_mask(int64_t t, bool window) {
  Ref pos = mem_.allocate(t * 8, tmp_);
  Ref diff = mem_.allocate(t * t * 8, tmp_);
  Ref blocked = mem_.allocate(t * t, tmp_);
  if (window) {
    Ref far = mem_.allocate(t * t, tmp_);
    blocked = mem_.allocate(t * t, tmp_);
  }
  return blocked;
}

Tensor Ops::fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionShape& s, bool windowed,
                            bool copies_output, bool keepable) {
  const int64_t t = s.seq, qw = s.heads * s.head_dim;
  const int out_lbl = act("attention outputs", "attention output B·T·heads·head_dim, and its float32 log-sum-exp");
  const int e = q.elem;
  Ref mask;
  if (windowed) {
    // The boolean mask of allowed positions, which the kernel turns into an additive float32 one:
    // that is the one it keeps.
    Ref blocked = blocked_mask(t, true);
    Ref allowed = mem_.allocate(t * t, tmp_);
    blocked.reset();
    mask =
        mem_.allocate(t * t * 4, act("attention masks", "seq × seq masks: boolean, or float32 for the fused kernel"));
  }
  const bool rg = q.requires_grad() || k.requires_grad() || v.requires_grad();
  const bool keep = keepable && kept_ && !windowed && attention_kernel_available(kept_->cuda, e, s.head_dim);
  Tensor y = g_->adopt(output_buffer(s.tokens() * qw * e, out_lbl, keep), s.tokens() * qw, e, rg);
  Ref lse = output_buffer(s.batch * s.heads * t * 4, out_lbl, keep);
  std::vector<Ref> saved{q.buf, k.buf, v.buf, y.buf, lse};
  if (mask) saved.push_back(mask);
  g_->record({&y}, saved, [this, q = meta(q), k = meta(k), v = meta(v)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(q), grad_to(k), grad_to(v)};
  });
  // The CPU kernel writes its output in the query's layout: [B, T, heads, hd] for a transposed
  // projection, where transpose + reshape is a view; a contiguous [B, heads, T, hd] query makes the
  // reshape copy.
  if (!copies_output) return y;
  Tensor copy = make(y.numel, e, out_lbl, rg);
  g_->record({&copy}, {}, [y = meta(y)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(y, in[0])}; });
  return copy;
}

Tensor Ops::math_fallback_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionShape& s,
                                    double dropout_p) {
  // q and k scaled by sqrt(scale), copied to contiguous batches when B > 1 (as is v), q·kᵀ, + the
  // causal mask, softmax, dropout, p·v; the output comes back as [B, heads, T, hd], so transpose +
  // reshape copies it. It computes in float32: 2-byte q, k and v are upcast first, the output cast
  // back.
  const int64_t t = s.seq, qw = s.heads * s.head_dim, scores = s.batch * s.heads * t * t;
  const int qkv_lbl =
      act("attention q, k, v", "queries, keys and values (after rotary), B·T·(heads + 2·kv_heads)·head_dim");
  const int out_lbl = act("attention outputs", "attention output B·T·heads·head_dim, and its float32 log-sum-exp");
  const int lbl = act("attention scores", "B·heads·seq² per matrix kept: softmax, dropout mask and output");
  const int e = q.elem, ce = 4;
  const bool rg = q.requires_grad() || k.requires_grad() || v.requires_grad();
  auto batched = [&](const Tensor& x) {
    if (s.batch == 1) return x;
    Tensor c = make(x.numel, ce, qkv_lbl, x.requires_grad());
    g_->record({&c}, {}, [x = meta(x)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(x, in[0])}; });
    return c;
  };
  Tensor q32 = cast(q, ce, qkv_lbl), k32 = cast(k, ce, qkv_lbl), v32 = cast(v, ce, qkv_lbl);
  Tensor qs = batched(scale(q32, qkv_lbl)), ks = batched(scale(k32, qkv_lbl)), vc = batched(v32);
  q32 = k32 = v32 = Tensor{};
  Tensor raw = make(scores, ce, lbl, qs.requires_grad() || ks.requires_grad());
  g_->record({&raw}, {qs.buf, ks.buf}, [this, qs = meta(qs), ks = meta(ks)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(qs), grad_to(ks)};
  });
  qs = ks = Tensor{};
  Ref causal = mem_.allocate(t * t * ce, tmp_);
  Tensor masked = view(raw);  // + the mask, in place
  raw = Tensor{};
  Tensor probs = make(scores, ce, lbl, masked.requires_grad());
  g_->record({&probs}, {probs.buf},
             [this, masked = meta(masked)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(masked)}; });
  {
    // _safe_softmax checks for rows that are all -inf: a boolean of the scores, and one per row.
    Ref neginf = mem_.allocate(scores, tmp_), all = mem_.allocate(s.batch * s.heads * t, tmp_);
  }
  masked = Tensor{};
  probs = dropout(probs, dropout_p, lbl);
  Tensor heads_out = make(s.tokens() * qw, ce, tmp_, rg);
  g_->record({&heads_out}, {probs.buf, vc.buf}, [this, probs = meta(probs), vc = meta(vc)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(probs), grad_to(vc)};
  });
  probs = vc = Tensor{};
  causal.reset();  // the float32 mask is a local of ATen's math attention, alive until it returns
  heads_out = cast(heads_out, e, tmp_);
  return merge_heads(heads_out, out_lbl);
}

Tensor Ops::explicit_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionShape& s,
                               bool windowed, double dropout_p) {
  const int64_t t = s.seq, qw = s.heads * s.head_dim, scores = s.batch * s.heads * t * t;
  const int qkv_lbl =
      act("attention q, k, v", "queries, keys and values (after rotary), B·T·(heads + 2·kv_heads)·head_dim");
  const int out_lbl = act("attention outputs", "attention output B·T·heads·head_dim, and its float32 log-sum-exp");
  const int lbl = act("attention scores", "B·heads·seq² score and probability matrices kept for backward");
  const int e = q.elem;
  const bool rg = q.requires_grad() || k.requires_grad() || v.requires_grad();
  const int64_t groups = s.heads / s.kv_heads;
  Tensor kk = k, vv = v;
  if (groups > 1) {
    kk = make(s.tokens() * qw, e, qkv_lbl, k.requires_grad());
    g_->record({&kk}, {}, [this, k = meta(k)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(k)}; });
    vv = make(s.tokens() * qw, e, qkv_lbl, v.requires_grad());
    g_->record({&vv}, {}, [this, v = meta(v)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(v)}; });
  }
  // matmul folds [B, heads] into one batch dimension: transposed views are copied first.
  Tensor qc = make(q.numel, e, qkv_lbl, q.requires_grad());
  g_->record({&qc}, {}, [q = meta(q)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(q, in[0])}; });
  Tensor kc = make(kk.numel, e, qkv_lbl, kk.requires_grad());
  g_->record({&kc}, {}, [kk = meta(kk)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(kk, in[0])}; });
  Tensor raw = make(scores, e, lbl, qc.requires_grad() || kc.requires_grad());
  g_->record({&raw}, {qc.buf, kc.buf}, [this, qc = meta(qc), kc = meta(kc)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(qc), grad_to(kc)};
  });
  qc = kc = kk = Tensor{};
  Tensor scaled = scale(raw, lbl);
  raw = Tensor{};
  Ref blocked = blocked_mask(t, windowed);
  Ref mask = mem_.allocate(t * t, act("attention masks", "boolean seq × seq masks"));
  blocked.reset();
  Tensor masked = make(scores, e, lbl, scaled.requires_grad());
  g_->record({&masked}, {mask},
             [this, scaled = meta(scaled)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(scaled)}; });
  scaled = Tensor{};
  // `scores` (the masked matrix) is a local of causal_attention: it lives until the function returns.
  Tensor in32 = cast(masked, 4, lbl);
  Tensor probs32 = make(scores, 4, lbl, in32.requires_grad());
  g_->record({&probs32}, {probs32.buf},
             [this, in32 = meta(in32)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(in32)}; });
  in32 = Tensor{};
  Tensor probs = cast(probs32, e, lbl);
  probs32 = Tensor{};
  if (dropout_p > 0) probs = dropout(probs, dropout_p, lbl);
  Tensor vc = vv;
  if (groups == 1) {
    vc = make(vv.numel, e, qkv_lbl, vv.requires_grad());
    g_->record({&vc}, {},
               [vv = meta(vv)](const std::vector<Ref>& in) { return std::vector<Emit>{pass_to(vv, in[0])}; });
  }
  Tensor heads_out = make(s.tokens() * qw, e, tmp_, rg);
  g_->record({&heads_out}, {probs.buf, vc.buf}, [this, probs = meta(probs), vc = meta(vc)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(probs), grad_to(vc)};
  });
  masked = probs = vc = Tensor{};
  return merge_heads(heads_out, out_lbl);
}

Tensor Ops::mixture_of_experts(const Tensor& x, const Param& router, const std::vector<ExpertWeights>& experts,
                               int64_t top_k, bool normalise, const std::vector<int64_t>& loads, bool gate_relu,
                               bool stats, int aux_label) {
  const int64_t count = static_cast<int64_t>(experts.size()), d = router.cols, rows = x.numel / d;
  const int64_t picks = rows * top_k;
  const int logits_lbl = act("router logits", "router logits and float32 probabilities, B·T·experts each");
  const int topk_lbl = act("top-k weights and indices", "B·T·top_k routing weights (float32 and cast) and int64 "
                                                        "indices, and the int64 order that groups them by expert");
  const int gather_lbl = act("expert gather buffers", "the tokens gathered by expert, B·T·top_k·hidden");
  const int mlp_lbl = act("expert activations", "gate, up and their product per expert, B·T·top_k·moe_intermediate each");
  const int scatter_lbl =
      act("expert scatter buffers", "the experts' outputs joined and weighted, B·T·top_k·hidden, summed into B·T·hidden");
  Tensor flat = view(x);
  Tensor logits = linear(flat, router, nullptr, logits_lbl);
  const int e = logits.elem;
  // softmax(dtype=float32): a 2-byte input is converted first; softmax keeps its output.
  Tensor converted = cast(logits, 4, tmp_);
  Tensor probs = make(rows * count, 4, logits_lbl, converted.requires_grad());
  g_->record({&probs}, {probs.buf}, [this, in = meta(converted)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(in)};
  });
  converted = logits = Tensor{};
  // topk: the values, and the indices it keeps; backward scatters into zeros of the input's size.
  Tensor top = make(picks, 4, topk_lbl, probs.requires_grad());
  Ref indices = mem_.allocate(picks * 8, topk_lbl);
  g_->record({&top}, {indices}, [this, probs = meta(probs)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(probs)};
  });
  if (normalise) {
    Tensor sum = make(rows, 4, tmp_, top.requires_grad());
    // sum's backward expands its gradient: a view, which the engine adds out of place.
    g_->record({&sum}, {}, [top = meta(top)](const std::vector<Ref>& in) {
      return std::vector<Emit>{Emit{top.slot, in[0], true}};
    });
    Tensor divided = make(picks, 4, topk_lbl, top.requires_grad());
    g_->record({&divided}, {top.buf, sum.buf}, [this, top = meta(top), sum = meta(sum)](const std::vector<Ref>&) {
      Emit self = grad_to(top);
      Ref a = g_->scratch(top.bytes()), b = g_->scratch(top.bytes());  // -grad · self / other²
      return std::vector<Emit>{self, grad_to(sum)};
    });
    top = divided;
  }
  Tensor weights = cast(top, e, topk_lbl);
  top = Tensor{};
  if (stats) {
    // bincount of the choices (int64), as float32; the probabilities summed per expert.
    { Ref counted = mem_.allocate(count * 8, tmp_); }
    Ref assigned = mem_.allocate(count * 4, aux_label);
    Tensor summed = make(count, 4, aux_label, probs.requires_grad());
    g_->record({&summed}, {}, [probs = meta(probs)](const std::vector<Ref>& in) {
      return std::vector<Emit>{Emit{probs.slot, in[0], true}};
    });
    aux_.push_back(summed);
    aux_refs_.push_back(assigned);
  }
  probs = Tensor{};
  // Without gradients: the stable sort's values and order, each token's row, the loads.
  Ref order, token;
  {
    Ref values = mem_.allocate(picks * 8, tmp_);
    order = mem_.allocate(picks * 8, topk_lbl);
    token = mem_.allocate(picks * 8, topk_lbl);
    values.reset();
  }
  Ref sizes = mem_.allocate(count * 8, tmp_);
  Tensor gathered = make(picks * d, flat.elem, gather_lbl, flat.requires_grad());
  g_->record({&gathered}, {token}, [this, flat = meta(flat)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(flat)};  // zeros of the input's size, index_add
  });
  Tensor weight = make(picks, weights.elem, topk_lbl, weights.requires_grad());
  g_->record({&weight}, {order}, [this, w = meta(weights)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(w)};
  });
  weights = Tensor{};
  std::vector<Tensor> pieces;
  std::vector<const Tensor*> piece_ptrs;
  pieces.reserve(experts.size());
  for (int64_t load : loads) pieces.push_back(g_->alias(gathered, load * d));
  for (const Tensor& t : pieces) piece_ptrs.push_back(&t);
  // split's backward: one concatenation of the pieces' gradients.
  g_->record(piece_ptrs, {}, [this, gathered = meta(gathered)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(gathered)};
  });
  gathered = Tensor{};
  std::vector<Tensor> outputs;
  outputs.reserve(experts.size());
  for (size_t i = 0; i < experts.size(); ++i) {
    Tensor gate = activation(linear(pieces[i], *experts[i].gate, nullptr, mlp_lbl), gate_relu);
    Tensor up = linear(pieces[i], *experts[i].up, nullptr, mlp_lbl);
    Tensor h = mul(gate, up, mlp_lbl);
    gate = up = Tensor{};
    outputs.push_back(linear(h, *experts[i].down, nullptr, scatter_lbl));
  }
  pieces.clear();
  const int out_elem = outputs.empty() ? e : outputs.front().elem;
  bool any_output_grad = false;
  for (const Tensor& o : outputs) any_output_grad |= o.requires_grad();
  Tensor joined = make(picks * d, out_elem, scatter_lbl, any_output_grad);
  std::vector<SlotPtr> slots;
  for (const Tensor& o : outputs) slots.push_back(o.slot);
  g_->record({&joined}, {}, [slots](const std::vector<Ref>& in) {
    std::vector<Emit> out;
    for (const SlotPtr& s : slots) out.push_back(Emit{s, in[0], true});  // narrow views of the gradient
    return out;
  });
  outputs.clear();
  Tensor weighted = mul(joined, weight, scatter_lbl);
  joined = weight = Tensor{};
  // zeros [tokens, hidden], index_add_ in place: backward selects the gradient's rows (its formula
  // keeps the source, for its shape).
  Tensor out = make(rows * d, weighted.elem, scatter_lbl, weighted.requires_grad());
  g_->record({&out}, {token, weighted.buf}, [this, weighted = meta(weighted)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(weighted)};
  });
  return view(out);
}

Tensor Ops::embedding(const Param& table, int64_t tokens, int elem, int label) {
  Tensor x = make(tokens * table.cols, elem, label, table.t.requires_grad());
  g_->record({&x}, {}, [this, &table](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(table.t)}; });
  return x;
}

Tensor Ops::token_loss(Tensor logits, int64_t tokens, int64_t vocab, int targets_label, int loss_label) {
  Tensor x32 = cast(logits, 4, mem_.label("logits", Category::logits));
  // The targets are a narrow of the batch's [B, T + 1] tokens: flattening them copies.
  Ref targets = mem_.allocate(tokens * 8, targets_label);
  Tensor lsm = make(tokens * vocab, 4, loss_label, x32.requires_grad());
  g_->record({&lsm}, {lsm.buf},
             [this, x32 = meta(x32)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x32)}; });
  x32 = logits = Tensor{};
  Tensor loss = make(1, 4, loss_label, lsm.requires_grad());
  Ref total_weight = mem_.allocate(4, loss_label);
  g_->record({&loss}, {targets, total_weight},
             [this, lsm = meta(lsm)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(lsm)}; });
  return loss;
}

Tensor Ops::parallel_embedding(const Param& table, int64_t tokens, int elem, int label) {
  const int ids_lbl = mem_.label("tensor-parallel ids", Category::activations,
                                 "the shifted ids (8 bytes) and the outside-the-share mask (1 byte) per token");
  Ref outside = mem_.allocate(tokens, ids_lbl);
  mem_.allocate(tokens, tmp_).reset();  // ids >= end, or-ed into the mask
  Ref local = mem_.allocate(tokens * 8, ids_lbl);
  Tensor x = make(tokens * table.cols, elem, label, table.t.requires_grad());
  g_->record({&x}, {local}, [this, &table](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(table.t)}; });
  Tensor filled = g_->alias(x, x.numel);
  g_->record({&filled}, {outside},
             [this, x = meta(x)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(x)}; });
  return filled;
}

Tensor Ops::parallel_token_loss(Tensor logits, int64_t tokens, int64_t vocab, int targets_label, int loss_label) {
  const int elem = logits.elem;
  const bool rg = logits.requires_grad();
  Ref softmax = mem_.allocate(tokens * vocab * 4, loss_label);
  Ref top = mem_.allocate(tokens * 4, tmp_);
  Ref targets = mem_.allocate(tokens * 8, targets_label);
  Ref inside = mem_.allocate(tokens, loss_label);
  mem_.allocate(tokens, tmp_).reset();  // targets < end, and-ed into the mask
  Ref local = mem_.allocate(tokens * 8, loss_label);
  mem_.allocate(tokens, tmp_).reset();  // the mask negated
  Ref picked = mem_.allocate(tokens * 4, tmp_);
  mem_.allocate(tokens, tmp_).reset();  // the mask negated
  Ref total = mem_.allocate(tokens * 4, tmp_);
  mem_.allocate(tokens * 4, tmp_).reset();  // log(total) - picked, before its mean
  Tensor loss = make(1, 4, loss_label, rg);
  g_->record({&loss}, {softmax, local, inside},
             [this, logits = meta(logits), tokens, vocab, elem](const std::vector<Ref>&) {
               Ref g = mem_.allocate(tokens * vocab * 4, tmp_);
               mem_.allocate(tokens * 4, tmp_).reset();  // the mask as float32, negated
               mem_.allocate(4, tmp_).reset();           // the incoming gradient over the tokens
               if (elem == 4) return std::vector<Emit>{pass_to(logits, g)};
               return std::vector<Emit>{pass_to(logits, mem_.allocate(tokens * vocab * elem, tmp_))};
             });
  logits = Tensor{};
  return loss;
}

Tensor Ops::chunked_loss(const Tensor& hidden, const Param& head, int64_t tokens, int64_t chunk, int targets_label,
                         int loss_label) {
  const int64_t h = head.cols, vocab = head.rows;
  const int he = hidden.elem, we = head.t.elem, ce = mixed_ ? 2 : hidden.elem;
  const int logits_lbl = mem_.label("loss chunk logits", Category::logits,
                                    "--loss chunked: one chunk's logits, chunk × vocab in the matmul dtype and in "
                                    "float32 (forward, and again in backward)");
  const int copy_lbl = act("autocast activation copies", "2-byte copies of float32 matmul inputs");
  Ref targets = mem_.allocate(tokens * 8, targets_label);
  Ref hc = ce != he ? mem_.allocate(tokens * h * ce, copy_lbl) : hidden.buf;
  Ref wc = ce != we ? mem_.allocate(vocab * h * ce, copies_) : nullptr;
  Ref lse = mem_.allocate(tokens * 4, loss_label);
  Ref total = mem_.allocate(4, loss_label);
  // A chunk's float32 logits: the matmul's output in the compute dtype, then its upcast (none in float32).
  auto chunk_logits = [this, vocab, ce, logits_lbl](int64_t n) {
    Ref logits = mem_.allocate(n * vocab * ce, logits_lbl);
    return ce == 4 ? logits : mem_.allocate(n * vocab * 4, logits_lbl);
  };
  for (int64_t s = 0; s < tokens; s += chunk) {
    const int64_t n = std::min(chunk, tokens - s);
    Ref lf = chunk_logits(n);
    Ref picked = mem_.allocate(n * 4, tmp_), top = mem_.allocate(n * 4, tmp_), sum = mem_.allocate(n * 4, tmp_);
    lf.reset();
    Ref diff = mem_.allocate(n * 4, tmp_);
    Ref part = mem_.allocate(4, tmp_);
  }
  wc.reset();
  const bool rg = hidden.requires_grad() || head.t.requires_grad();
  Tensor loss = make(1, 4, loss_label, rg);
  total.reset();
  g_->record({&loss}, {hc, targets, lse},
             [this, hidden = meta(hidden), head = meta(head.t), tokens, chunk, h, vocab, he, we, ce, logits_lbl,
              chunk_logits](const std::vector<Ref>&) {
               Ref wc = ce != we ? mem_.allocate(vocab * h * ce, copies_) : nullptr;
               Ref grad_h = mem_.allocate(tokens * h * ce, tmp_);
               Ref grad_w = head.slot ? mem_.allocate(vocab * h * 4, tmp_) : nullptr;
               Ref scale = mem_.allocate(4, tmp_);
               for (int64_t s = 0; s < tokens; s += chunk) {
                 const int64_t n = std::min(chunk, tokens - s);
                 Ref lf = chunk_logits(n);
                 Ref picked = mem_.allocate(n * 4, tmp_);
                 picked.reset();
                 if (ce != 4) {
                   Ref low = mem_.allocate(n * vocab * ce, logits_lbl);
                   if (grad_w) {
                     low.reset();
                     Ref h32 = mem_.allocate(n * h * 4, tmp_);
                   }
                 }
               }
               wc.reset();
               if (grad_w && ce != 4) {
                 Ref rounded = mem_.allocate(vocab * h * ce, tmp_);
                 if (we == ce) {
                   grad_w = rounded;
                 }
               }
               if (he != ce) grad_h = mem_.allocate(tokens * h * he, tmp_);
               std::vector<Emit> e;
               if (hidden.slot) e.push_back(Emit{hidden.slot, grad_h});
               if (head.slot) e.push_back(Emit{head.slot, grad_w});
               return e;
             });
  return loss;
}

const std::vector<std::string>& modeled_operators() {
  static const std::vector<std::string> names = {
      "cast",
      "linear",
      "add",
      "mul",
      "scale",
      "rms_norm",
      "layer_norm",
      "activation",
      "dropout",
      "rotary",
      "embedding",
      "token_loss",
      "chunked_loss",
      "parallel_embedding",
      "parallel_token_loss",
      "fused_attention",
      "math_fallback_attention",
      "explicit_attention",
      "mixture_of_experts",
  };
  return names;
}

}  // namespace headroom::sim
