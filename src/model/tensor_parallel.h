// Tensor parallel — a layer's matrices split across T ranks (lever 6, model parallelism), as
// Megatron-LM lays them out: each rank holds a contiguous share of the attention heads and of the
// MLP's inner dimension, and of the vocabulary.
//
// Per block: the (replicated) normed input enters the block through enter_parallel (nothing in
// forward, the input's gradient summed over the ranks in backward); the column-parallel projections
// (q, k, v; gate, up) give this rank's heads or inner columns; the row-parallel one (o; down) gives a
// partial sum, which leave_parallel sums over the ranks in forward (in place; nothing in backward),
// its bias added after the sum. Norms, position embeddings and residuals are replicated: their
// gradients come out equal on every rank without a collective.
//
// Sequence parallel (on by default, as torch's SequenceParallel and Megatron-LM run it): what lies
// between the projections — the norms, the residual stream, dropout, the embeddings' sum — holds
// only 1/T of the tokens on each rank. gather_sequence all-gathers the normed tokens before the
// column-parallel projections (and the head); scatter_sequence reduce-scatters the row-parallel
// partial sums instead of all-reducing them. The replicated parameters used there (norm weights,
// the biases added after the sum, position embeddings) then see only their rank's tokens: their
// gradients are summed over the ranks in backward (shared_gradient).
//
// Key/value heads: with T dividing their number each rank holds its share; with T a multiple of it
// each is replicated on T / kv ranks (the ranks whose query heads read it), and so are per-head
// q/k norms on every rank: shared_gradient sums those copies' gradients over the ranks in backward,
// so every copy takes the same update. Other head counts are refused.
//
// The vocabulary: the embedding holds rows [begin, end) of it (a token outside gives zeros, the sum
// over the ranks the embedding), the head the same rows (tied, the same tensor), and
// parallel_token_loss takes the cross-entropy over the split logits with three collectives of one
// number per token — the largest logit, the target's logit and the sum of exponentials — so no rank
// ever holds the whole [tokens, vocab] logits.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "config/model_config.h"

namespace headroom {

// A contiguous range [begin, begin + size).
struct Span {
  int64_t begin = 0, size = 0;
  int64_t end() const { return begin + size; }
};

// Which share of the layers' matrices this rank holds, and the collectives over the ranks that
// hold the others. The default is the whole.
struct TensorSlice {
  int64_t rank = 0, ranks = 1;
  // Sequence parallel: between the blocks (the norms, residuals and dropouts) each rank holds 1/T of
  // the batch's tokens, [B, seq/T, hidden] — part r of the flattened [B·seq, hidden] — instead of
  // all of them (see gather_sequence and scatter_sequence).
  bool sequence = false;
  // Sums `t` in place over the ranks (max: takes the largest), every rank ending with the result.
  // Unset on the meta device (shapes only); a forward then is an error.
  std::function<void(at::Tensor&, bool max)> allreduce;
  // Sequence parallel's: `out` gets the ranks' `in` one after the other (allgather), or this
  // rank's chunk of `in`'s sum over the ranks (reduce_scatter); contiguous tensors, flat chunks.
  std::function<void(at::Tensor& out, at::Tensor& in)> allgather, reduce_scatter;

  bool whole() const { return ranks == 1; }
  // This rank's query heads, of `heads`.
  Span heads(int64_t heads) const;
  // The key/value heads its query heads read, of the config's.
  Span kv_heads(const ModelConfig& c) const;
  // Whether a key/value head is held by more than one rank (T a multiple of their number, > it).
  bool kv_replicated(const ModelConfig& c) const { return ranks > c.num_kv_heads; }
  // An even share of `n` (the MLP's inner dimension).
  Span share(int64_t n) const;
  // The vocabulary rows: floor(rank·V / T) to floor((rank+1)·V / T).
  Span vocab(int64_t vocab) const;
  // Sequence parallel is on (and there is more than one rank).
  bool splits_sequence() const { return sequence && ranks > 1; }
};

// A parameter's share of the whole tensor `whole` (its shape): the spans along `dim` this rank holds,
// in order, side by side (a fused q/k/v projection holds three).
struct TensorCut {
  int64_t dim = 0;
  std::vector<Span> spans;
  std::vector<int64_t> whole;
  // This rank's share's shape, and the share of a whole tensor (a copy).
  std::vector<int64_t> sizes() const;
  at::Tensor take(const at::Tensor& whole_tensor) const;
};

// Throws Error (one line, with what is accepted) when the model cannot be split over `ranks`: query
// heads or the MLP's inner dimension not divisible, key/value heads neither divisible nor dividing,
// more ranks than vocabulary rows, a mixture of experts, or q/k norms over the whole projection.
void check_tensor_parallel(const ModelConfig& c, int64_t ranks);
// What --tensor-parallel says of a layout's key/value heads ("" when nothing is replicated).
std::string kv_replication_note(const ModelConfig& c, int64_t ranks);

// The autograd pieces; `slice` must outlive the graph (the model's own).
// Identity in forward; backward sums the input's gradient over the ranks.
at::Tensor enter_parallel(const at::Tensor& x, const TensorSlice& slice);
// Sums `partial` over the ranks in forward (in place); identity in backward.
at::Tensor leave_parallel(const at::Tensor& partial, const TensorSlice& slice);
// A parameter replicated on every rank but used by each on its own heads: identity in forward, its
// gradient summed over the ranks in backward.
at::Tensor shared_gradient(const at::Tensor& param, const TensorSlice& slice);
// A parameter of key/value rows [span·unit, ...) (along `dim`) of a tensor `full_rows` rows long,
// replicated on the ranks that hold the same heads: identity in forward; in backward the gradient is
// summed over those ranks (placed in a zero tensor of the full rows, summed over every rank, and
// this rank's rows taken back).
at::Tensor replicated_rows_gradient(const at::Tensor& param, int64_t dim, int64_t begin, int64_t full_rows,
                                    const TensorSlice& slice);
// Sequence parallel. gather_sequence: this rank's part [B, seq/T, hidden] → the whole [B, seq,
// hidden] (an all-gather; backward reduce-scatters the gradient), before the column-parallel
// projections and the head. scatter_sequence: a row-parallel projection's partial product [B, seq,
// hidden] → this rank's part of its sum over the ranks (a reduce-scatter; backward all-gathers the
// gradient), in place of leave_parallel.
at::Tensor gather_sequence(const at::Tensor& part, const TensorSlice& slice);
at::Tensor scatter_sequence(const at::Tensor& partial, const TensorSlice& slice);
// Sequence parallel: the positions of this rank's part of a [B, seq] batch, [B, seq/T] int64 —
// position i of the flattened tokens is i % seq.
at::Tensor sequence_positions(int64_t batch, int64_t seq, const TensorSlice& slice, const at::TensorOptions& options);
// The embedding of `ids` through this rank's vocabulary rows `weight` ([span.size, hidden]), summed
// over the ranks: the whole embedding on every rank (sequence parallel: this rank's part of it).
at::Tensor parallel_embedding(const at::Tensor& weight, const at::Tensor& ids, const TensorSlice& slice,
                              int64_t vocab);
// The mean cross-entropy over every token of the split logits [..., span.size] (any dtype; float32
// inside) against `targets` (int64, the logits' leading shape): the same number on every rank. Saves
// the float32 softmax of this rank's share for backward.
at::Tensor parallel_token_loss(const at::Tensor& logits, const at::Tensor& targets, const TensorSlice& slice,
                               int64_t vocab);

}  // namespace headroom
