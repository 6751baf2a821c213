// The attention operators of estimate/ops.h: model/attention.cpp's three paths and the pieces they share.
#include "device/attention_kernel_adapter.h"
#include "estimate/ops.h"

namespace headroom::sim {

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

}  // namespace headroom::sim
