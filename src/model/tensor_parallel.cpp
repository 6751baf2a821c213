#include "model/tensor_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "util/error.h"

namespace headroom {

Span TensorSlice::heads(int64_t heads) const {
  const int64_t each = heads / ranks;
  return {rank * each, each};
}

Span TensorSlice::kv_heads(const ModelConfig& c) const {
  if (ranks <= c.num_kv_heads) {
    const int64_t each = c.num_kv_heads / ranks;
    return {rank * each, each};
  }
  return {rank / (ranks / c.num_kv_heads), 1};  // replicated on ranks / kv consecutive ranks
}

Span TensorSlice::share(int64_t n) const {
  const int64_t each = n / ranks;
  return {rank * each, each};
}

Span TensorSlice::vocab(int64_t vocab) const {
  const int64_t begin = rank * vocab / ranks, end = (rank + 1) * vocab / ranks;
  return {begin, end - begin};
}

std::vector<int64_t> TensorCut::sizes() const {
  std::vector<int64_t> out = whole;
  out[static_cast<size_t>(dim)] = 0;
  for (const Span& s : spans) out[static_cast<size_t>(dim)] += s.size;
  return out;
}

at::Tensor TensorCut::take(const at::Tensor& whole_tensor) const {
  std::vector<at::Tensor> parts;
  for (const Span& s : spans) parts.push_back(whole_tensor.narrow(dim, s.begin, s.size));
  return at::cat(parts, dim);
}

void check_tensor_parallel(const ModelConfig& c, int64_t t) {
  if (t < 1) fail("--tensor-parallel {}: accepted: a whole number of ranks, 1 or more", t);
  if (t == 1) return;
  if (c.moe) {
    fail("--tensor-parallel with {} (a mixture of experts): not supported yet; accepted: --tensor-parallel 1 for it",
         c.name);
  }
  if (c.qk_norm == QkNorm::whole) {
    fail("--tensor-parallel with {}: its q/k norms span the whole projection, across the ranks' heads; not supported "
         "yet; accepted: --tensor-parallel 1 for it",
         c.name);
  }
  if (c.num_heads % t != 0) {
    fail("--tensor-parallel {}: {}'s {} attention heads do not split evenly; accepted: a divisor of {}", t, c.name,
         c.num_heads, c.num_heads);
  }
  if (c.num_kv_heads % t != 0 && t % c.num_kv_heads != 0) {
    fail("--tensor-parallel {}: {}'s {} key/value heads neither split evenly over {} ranks nor replicate evenly on "
         "them; accepted: a divisor or a multiple of {} (that divides {})",
         t, c.name, c.num_kv_heads, t, c.num_kv_heads, c.num_heads);
  }
  if (c.fused_qkv && t > c.num_kv_heads) {
    fail("--tensor-parallel {}: {}'s fused q/k/v projection with key/value heads replicated over ranks: not "
         "supported yet; accepted: a divisor of {}",
         t, c.name, c.num_kv_heads);
  }
  if (c.intermediate_size % t != 0) {
    fail("--tensor-parallel {}: {}'s MLP inner dimension {} does not split evenly; accepted: a divisor of it", t,
         c.name, c.intermediate_size);
  }
  if (c.vocab_size < t) fail("--tensor-parallel {}: more ranks than {}'s {} vocabulary rows", t, c.name, c.vocab_size);
}

std::string kv_replication_note(const ModelConfig& c, int64_t t) {
  if (t <= c.num_kv_heads) return "";
  return fmt::format("{}'s {} key/value heads are replicated, each on {} of the {} tensor-parallel ranks (their "
                     "gradients summed over its copies)",
                     c.name, c.num_kv_heads, t / c.num_kv_heads, t);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The slice travels through the graph by address (the model holds it for as long as its graph lives).
int64_t address(const TensorSlice& slice) { return reinterpret_cast<int64_t>(&slice); }
const TensorSlice& slice_at(AutogradContext* ctx) {
  return *reinterpret_cast<const TensorSlice*>(ctx->saved_data["slice"].toInt());
}
void sum(const TensorSlice& slice, at::Tensor& t, bool max = false) {
  TORCH_CHECK(slice.allreduce, "tensor parallel: a forward without the ranks' collective (a shapes-only model)");
  slice.allreduce(t, max);
}
at::Tensor summed_copy(const TensorSlice& slice, const at::Tensor& grad) {
  at::Tensor g = grad.contiguous();
  sum(slice, g);
  return g;
}

struct EnterParallel : public torch::autograd::Function<EnterParallel> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t slice) {
    ctx->saved_data["slice"] = slice;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    return {summed_copy(slice_at(ctx), grads[0]), at::Tensor()};
  }
};

struct LeaveParallel : public torch::autograd::Function<LeaveParallel> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& partial, int64_t slice) {
    at::Tensor x = partial;
    TORCH_CHECK(x.is_contiguous(), "leave_parallel: a contiguous partial sum");
    sum(*reinterpret_cast<const TensorSlice*>(slice), x);
    ctx->mark_dirty({partial});
    return partial;
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct ReplicatedRows : public torch::autograd::Function<ReplicatedRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& param, int64_t slice, int64_t begin,
                            int64_t full_rows) {
    ctx->saved_data["slice"] = slice;
    ctx->saved_data["begin"] = begin;
    ctx->saved_data["full_rows"] = full_rows;
    return param;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const int64_t begin = ctx->saved_data["begin"].toInt();
    std::vector<int64_t> sizes = g.sizes().vec();
    sizes[0] = ctx->saved_data["full_rows"].toInt();
    at::Tensor full = at::zeros(sizes, g.options());
    full.narrow(0, begin, g.size(0)).copy_(g);
    sum(slice_at(ctx), full);
    return {full.narrow(0, begin, g.size(0)).clone(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ParallelTokenLoss : public torch::autograd::Function<ParallelTokenLoss> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t slice_address, int64_t vocab) {
    const TensorSlice& slice = *reinterpret_cast<const TensorSlice*>(slice_address);
    const Span span = slice.vocab(vocab);
    const int64_t n = targets.numel();
    TORCH_CHECK(logits.size(-1) == span.size, "parallel_token_loss: logits of ", logits.size(-1),
                " vocabulary rows, this rank holds ", span.size);
    at::Tensor x = logits.reshape({n, span.size}).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    at::Tensor top = x.amax({1});
    sum(slice, top, /*max=*/true);
    x.sub_(top.unsqueeze(1));
    const at::Tensor t = targets.reshape({n});
    const at::Tensor inside = t.ge(span.begin).logical_and_(t.lt(span.end()));
    const at::Tensor local = (t - span.begin).masked_fill_(inside.logical_not(), 0);
    at::Tensor picked = x.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill_(inside.logical_not(), 0.0);
    sum(slice, picked);
    x.exp_();
    at::Tensor total = x.sum({1});
    sum(slice, total);
    x.div_(total.unsqueeze(1));  // the softmax of this rank's share
    ctx->save_for_backward({x, local, inside});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    ctx->saved_data["shape"] = logits.sizes().vec();
    return (total.log_() - picked).mean();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& local = saved[1];
    const at::Tensor& inside = saved[2];
    at::Tensor g = softmax.clone();
    g.scatter_add_(1, local.unsqueeze(1), inside.to(at::kFloat).neg_().unsqueeze(1));
    g.mul_(grads[0] / static_cast<double>(softmax.size(0)));
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {g.to(dtype).view(ctx->saved_data["shape"].toIntVector()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The whole tokens of a part: [B, seq/T, hidden] parts → [B, seq, hidden].
std::vector<int64_t> whole_sizes(const at::Tensor& part, int64_t ranks) {
  std::vector<int64_t> sizes = part.sizes().vec();
  sizes[1] *= ranks;
  return sizes;
}

at::Tensor all_gathered(const TensorSlice& slice, const at::Tensor& part) {
  TORCH_CHECK(slice.allgather, "sequence parallel: a forward without the ranks' collectives (a shapes-only model)");
  at::Tensor in = part.contiguous();
  at::Tensor out = at::empty(whole_sizes(in, slice.ranks), in.options());
  slice.allgather(out, in);
  return out;
}

at::Tensor reduce_scattered(const TensorSlice& slice, const at::Tensor& whole) {
  TORCH_CHECK(slice.reduce_scatter,
              "sequence parallel: a forward without the ranks' collectives (a shapes-only model)");
  TORCH_CHECK(whole.size(1) % slice.ranks == 0, "sequence parallel: ", whole.size(1), " positions over ", slice.ranks,
              " ranks");
  at::Tensor in = whole.contiguous();
  std::vector<int64_t> sizes = in.sizes().vec();
  sizes[1] /= slice.ranks;
  at::Tensor out = at::empty(sizes, in.options());
  slice.reduce_scatter(out, in);
  return out;
}

struct GatherSequence : public torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& part, int64_t slice) {
    ctx->saved_data["slice"] = slice;
    return all_gathered(*reinterpret_cast<const TensorSlice*>(slice), part);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    return {reduce_scattered(slice_at(ctx), grads[0]), at::Tensor()};
  }
};

struct ScatterSequence : public torch::autograd::Function<ScatterSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& partial, int64_t slice) {
    ctx->saved_data["slice"] = slice;
    return reduce_scattered(*reinterpret_cast<const TensorSlice*>(slice), partial);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    return {all_gathered(slice_at(ctx), grads[0]), at::Tensor()};
  }
};

}  // namespace

at::Tensor gather_sequence(const at::Tensor& part, const TensorSlice& slice) {
  return GatherSequence::apply(part, address(slice));
}

at::Tensor scatter_sequence(const at::Tensor& partial, const TensorSlice& slice) {
  return ScatterSequence::apply(partial, address(slice));
}

at::Tensor sequence_positions(int64_t batch, int64_t seq, const TensorSlice& slice, const at::TensorOptions& options) {
  const int64_t part = batch * seq / slice.ranks;
  return (at::arange(slice.rank * part, (slice.rank + 1) * part, options.dtype(at::kLong)) % seq)
      .view({batch, seq / slice.ranks});
}

at::Tensor enter_parallel(const at::Tensor& x, const TensorSlice& slice) {
  return EnterParallel::apply(x, address(slice));
}

at::Tensor leave_parallel(const at::Tensor& partial, const TensorSlice& slice) {
  return LeaveParallel::apply(partial, address(slice));
}

at::Tensor shared_gradient(const at::Tensor& param, const TensorSlice& slice) {
  return EnterParallel::apply(param, address(slice));
}

at::Tensor replicated_rows_gradient(const at::Tensor& param, int64_t dim, int64_t begin, int64_t full_rows,
                                    const TensorSlice& slice) {
  TORCH_CHECK(dim == 0, "replicated_rows_gradient: rows along dim 0");
  return ReplicatedRows::apply(param, address(slice), begin, full_rows);
}

at::Tensor parallel_embedding(const at::Tensor& weight, const at::Tensor& ids, const TensorSlice& slice,
                              int64_t vocab) {
  const Span span = slice.vocab(vocab);
  const at::Tensor outside = ids.lt(span.begin).logical_or_(ids.ge(span.end()));
  at::Tensor x = at::embedding(weight, (ids - span.begin).masked_fill_(outside, 0));
  x.masked_fill_(outside.unsqueeze(-1), 0.0);
  return slice.splits_sequence() ? scatter_sequence(x, slice) : leave_parallel(x, slice);
}

at::Tensor parallel_token_loss(const at::Tensor& logits, const at::Tensor& targets, const TensorSlice& slice,
                               int64_t vocab) {
  return ParallelTokenLoss::apply(logits, targets, address(slice), vocab);
}

}  // namespace headroom
