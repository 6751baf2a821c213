#include "estimate/ops.h"

#include <algorithm>

#include "config/checkpoint_policy.h"

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
