// Operator models — what each operator of a training step allocates, keeps for backward and frees,
// as LibTorch's CPU kernels and autograd formulas do it: one function per operator (or per
// headroom model function that composes them, as attention does), on the symbolic memory of
// estimate/sim.h. The estimator composes a step from these and nothing else; every one is held to
// the real operator, run under the budget allocator, by the operator table test (ops_test.cpp),
// which fails when an operator is modelled here without a case there.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "estimate/sim.h"

namespace headroom::sim {

// A parameter: its tensor, and its shape (cols 0: a vector).
struct Param {
  Tensor t;
  int64_t rows = 0, cols = 0;
};

// The call of an attention operator: queries [B, T, heads·hd], keys and values [B, T, kv_heads·hd].
struct AttentionShape {
  int64_t batch = 1, seq = 1, heads = 1, kv_heads = 1, head_dim = 1;
  int64_t tokens() const { return batch * seq; }
};

// Per-op checkpointing (model/op_checkpoint.h): one layer's kept outputs. While an Ops has one set,
// the operators the policy keeps — a matmul without bias in its odd turns (counted per pass), the
// fused attention kernel where the trainer can call its backward — make their outputs and keep them
// (the forward), or take the kept ones back instead of allocating (the recompute).
struct KeptOps {
  bool cuda = false;
  bool recompute = false;
  int64_t matmuls = 0;
  std::vector<Ref> outputs;  // in the forward's order (attention: its output, then its log-sum-exp)
  size_t next = 0;
};

class Ops {
 public:
  // `mixed`: matmuls run under autocast, on 2-byte copies of their inputs and weights.
  Ops(bool mixed);
  Ops(const Ops&) = delete;
  Ops& operator=(const Ops&) = delete;

  // ---- labels and gradients ----
  int act(std::string_view name, std::string_view formula) {
    return mem_.label(name, Category::activations, formula);
  }

  // What a backward node remembers of a tensor it does not save: its size and gradient slot.
  static Tensor meta(const Tensor& t) {
    Tensor m = t;
    m.buf = nullptr;
    return m;
  }

  Emit grad_to(const Tensor& x) { return x.slot ? Emit{x.slot, mem_.allocate(x.bytes(), tmp_)} : Emit{}; }
  static Emit pass_to(const Tensor& x, const Ref& g) { return Emit{x.slot, g}; }

  // `rg`: the output requires grad (an input does, and grad mode is on).
  Tensor make(int64_t numel, int elem, int label, bool rg) { return g_->make(numel, elem, label, rg); }

  // x.to(elem): a copy when the dtype changes; backward casts the gradient back.
  Tensor cast(const Tensor& x, int elem, int label);

  // What a matmul under autocast reads: a 2-byte copy of a parameter, cached for the autocast scope
  // when the parameter requires grad (autocast caches only those); a frozen one's is made anew at
  // each use, and lives as long as a backward node saves it.
  Tensor weight_in(const Param& p);

  // x · wᵀ + b: saves the input only for the weight's gradient and the weight (autocast's copy) only
  // for the input's, as autograd does; a frozen weight gets no gradient.
  Tensor linear(const Tensor& x, const Param& w, const Param* b, int label);

  // x · Wᵀ + b over an NF4 weight [out, in] (model/nf4.h's nf4_linear), W dequantised in the compute
  // dtype (`elem`: autocast's 2 bytes, else the parameters'): in forward W, autocast's copies of x
  // and b, the output, then W freed; nothing saved; in backward W again and the input's gradient in
  // that dtype, then W freed, and the engine's cast of that gradient to x's dtype where it differs.
  Tensor nf4_linear(const Tensor& x, int64_t out, int64_t in, int elem, const Param* b, int label);

  // a + b (b may broadcast): the sum in the wider dtype; backward passes the gradient through,
  // converting or reducing it where an input differs.
  Tensor add(const Tensor& a, const Tensor& b, int label);

  // a * b, b possibly a broadcast weight or a constant: saves each for the other's gradient; a
  // broadcast operand's gradient is reduced from a full-size product.
  Tensor mul(const Tensor& a, const Tensor& b, int label);

  // x * python scalar: nothing saved.
  Tensor scale(const Tensor& x, int label);

  // A view with its own gradient slot whose gradient is passed through unchanged (view, transpose).
  Tensor view(const Tensor& x);

  // A narrow/chunk view: its backward writes into a zero-filled gradient of the whole input.
  Tensor slice(const Tensor& x, int64_t numel);

  // ATen's rms_norm: in float32 whatever the input (a 2-byte input is upcast first and the result
  // cast back): pow → mean → + eps → rsqrt → x · r → · weight. `plus_one` (gemma): the weight
  // used is 1 + w, a vector made first. The norm's width is the weight's.
  Tensor rms_norm(const Tensor& in, const Param& w, bool plus_one = false);

  Tensor layer_norm(const Tensor& x, const Param& w, const Param* b);

  // gelu or silu save their input; relu saves its result.
  Tensor activation(const Tensor& x, bool saves_result);

  // CPU dropout: input * (bernoulli mask / (1 - p)); the mask, in the input's dtype, is saved.
  Tensor dropout(const Tensor& x, double p, int label);

  // model/rotary.cpp's apply(): the leading `rd` features of each head rotated, the rest joined back.
  Tensor rotary(const Tensor& x, int64_t heads, int64_t head_dim, int64_t rd, const Tensor& cos, const Tensor& sin);

  // ---- attention (model/attention.cpp's paths); each returns [B, T, heads·hd] in q's dtype ----
  // at::scaled_dot_product_attention without dropout: the fused CPU kernel, which saves q, k, v,
  // the output and a float32 log-sum-exp (and the mask when windowed). `copies_output`: the query
  // is a contiguous [B, heads, T, hd] (partial rotary's cat), so the output comes back in that
  // layout and the reshape to [B, T, heads·hd] copies it.
  // `keepable`: per-op checkpointing may keep it (no window: the kernel of
  // device/attention_kernel_adapter.h runs it).
  Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionShape& s, bool windowed,
                         bool copies_output, bool keepable = false);
  // scaled_dot_product_attention with dropout: the CPU runs ATen's math attention in float32.
  Tensor math_fallback_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionShape& s,
                                 double dropout_p);
  // The explicit path (--attention math): q·kᵀ, scale, mask, float32 softmax, cast, p·v.
  Tensor explicit_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionShape& s, bool windowed,
                            double dropout_p);

  // model/experts.cpp's mixture_of_experts over x ([tokens, hidden]): the router's logits and
  // float32 probabilities, top-k, the renormalisation, the sort that groups tokens by expert, the
  // gathered inputs, each expert's gated MLP on its `loads` rows, the joined and weighted outputs
  // and the scatter back. `gate_relu`: the activation saves its result. `stats`: the load-balancing
  // loss's statistics are taken (probabilities summed per expert, under `aux_label`).
  struct ExpertWeights {
    const Param *gate, *up, *down;
  };
  Tensor mixture_of_experts(const Tensor& x, const Param& router, const std::vector<ExpertWeights>& experts,
                            int64_t top_k, bool normalise, const std::vector<int64_t>& loads, bool gate_relu,
                            bool stats, int aux_label);

  // at::embedding of `tokens` rows of `table` (its gradient: a dense table-sized buffer).
  Tensor embedding(const Param& table, int64_t tokens, int elem, int label);
  // The trainer's token_loss: logits.to(float32), the targets flattened (a copy, under
  // `targets_label`), then cross_entropy = nll_loss(log_softmax(x)). Returns the scalar loss;
  // the logits handle is released inside, where the real one goes.
  Tensor token_loss(Tensor logits, int64_t tokens, int64_t vocab, int targets_label, int loss_label);
  // Tensor parallel (model/tensor_parallel.h): the embedding of this rank's `table` rows, the ids
  // outside them masked (the ids shifted, kept by the embedding for backward; the mask, kept by the
  // in-place fill that zeroes their rows, whose backward fills a copy of the gradient), summed over
  // the ranks in place.
  Tensor parallel_embedding(const Param& table, int64_t tokens, int elem, int label);
  // parallel_token_loss over this rank's `vocab` logits: their float32 copy (made the softmax in
  // place, and kept), the targets flattened (a copy), the shifted targets and the mask (kept), and
  // per token the largest logit, the target's logit, the sum of exponentials and the loss. Backward:
  // a float32 copy of the softmax, made the gradient, and its cast to the logits' dtype. The logits
  // handle is released inside, as token_loss's.
  Tensor parallel_token_loss(Tensor logits, int64_t tokens, int64_t vocab, int targets_label, int loss_label);
  // model/chunked_loss.h's chunked_token_loss over `hidden` ([tokens, head.cols]) and the head
  // [vocab, hidden], `chunk` tokens at a time: the targets flattened (a copy), the hidden states in
  // the compute dtype (kept), the head's copy in it while forward runs, and per chunk its logits,
  // their float32 copy and the log-sum-exp's vectors; kept: one float32 per token. Backward: the
  // head's copy again, the hidden states' gradient, the head's float32 gradient, and per chunk the
  // recomputed logits, their float32 softmax and its copy in the compute dtype.
  Tensor chunked_loss(const Tensor& hidden, const Param& head, int64_t tokens, int64_t chunk, int targets_label,
                      int loss_label);

 protected:
  // An operator's output buffer of `bytes`: made (and kept, when `keep` and per-op checkpointing's
  // forward runs), or the kept one taken back in its recompute.
  Ref output_buffer(int64_t bytes, int label, bool keep);
  // The boolean mask of positions attention may not see, as model/attention.cpp builds it.
  Ref blocked_mask(int64_t t, bool window);
  // [B, heads, T, hd] heads merged into [B, T, heads·hd] by CausalLM::attention.
  Tensor merge_heads(const Tensor& heads_out, int label);
  // mixture_of_experts's pieces: its labels; the router's weights of each token's top-k experts
  // (and the top-k indices, kept); the experts' gated MLPs over the gathered rows, joined.
  struct ExpertLabels {
    int logits, topk, gather, mlp, scatter;
  };
  struct Routing {
    Tensor weights;
    Ref indices;
  };
  ExpertLabels expert_labels();
  Routing route(const Tensor& flat, const Param& router, int64_t count, int64_t top_k, bool normalise, bool stats,
                int aux_label, const ExpertLabels& l);
  Tensor run_experts(Tensor gathered, int64_t d, const std::vector<ExpertWeights>& experts,
                     const std::vector<int64_t>& loads, bool gate_relu, int out_elem, const ExpertLabels& l);

  Memory mem_;
  Graph graph_;
  Graph* g_;    // where operators record their backward (a checkpoint's recompute swaps in its own)
  int tmp_;     // backward temporaries and operator scratch
  int copies_;  // autocast's 2-byte weight copies
  bool mixed_;
  std::map<const Param*, Tensor>* cache_ = nullptr;  // autocast's weight copies, per forward
  KeptOps* kept_ = nullptr;                          // per-op checkpointing's layer, while it runs
  // The load-balancing loss's running statistics (mixture_of_experts with stats), per layer.
  std::vector<Tensor> aux_;
  std::vector<Ref> aux_refs_;
};

// The operators modelled above, by name; each has its case in the operator table test.
const std::vector<std::string>& modeled_operators();

}  // namespace headroom::sim
