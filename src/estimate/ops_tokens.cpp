// The ends of the step in estimate/ops.h: the embeddings and the losses (whole, vocabulary-parallel, chunked).
#include <algorithm>

#include "estimate/ops.h"

namespace headroom::sim {

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

}  // namespace headroom::sim
