#include "model/op_checkpoint.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <vector>

#include "config/checkpoint_policy.h"
#include "device/attention_kernel_adapter.h"
#include "device/autocast_adapter.h"
#include "model/checkpointing.h"

namespace headroom {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One layer's kept outputs, in the order its forward made them, and the count of its matmuls in
// the pass running now (the forward, or the recompute): the frame checkpointed() makes current
// while the layer runs (model/checkpointing.h).
struct Kept final : CheckpointFrame {
  void enter(bool recompute_pass) override;
  void leave() override;

  bool recompute = false;
  int64_t matmuls = 0;
  std::vector<at::Tensor> outputs;
  std::vector<AttentionKernelOutput> attention;
  size_t next_output = 0, next_attention = 0;
  Kept* previous = nullptr;
};

// The layer being run on this thread (the forward, or its recompute in backward), if any.
thread_local Kept* running = nullptr;

void Kept::enter(bool recompute_pass) {
  recompute = recompute_pass;
  matmuls = 0;
  previous = running;
  running = this;
}

void Kept::leave() { running = previous; }

// The recompute's matmul: the kept product handed back; backward as mm's (x·wᵀ's two products).
struct KeptMatmul : public torch::autograd::Function<KeptMatmul> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, at::Tensor product) {
    ctx->save_for_backward({x, w});
    return product;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor g = grads[0].reshape({-1, w.size(0)});
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) gx = at::mm(g, w).view(x.sizes());
    if (ctx->needs_input_grad(1)) gw = at::mm(g.t(), x.reshape({-1, w.size(1)}));
    return {gx, gw, at::Tensor()};
  }
};

// The recompute's attention: the kept kernel output handed back; backward the kernel's own.
struct KeptAttention : public torch::autograd::Function<KeptAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, const AttentionKernelOutput& f) {
    ctx->save_for_backward({q, k, v, f.out, f.logsumexp, f.cum_seq_q, f.cum_seq_k, f.rng_state, f.unused});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["max_q"] = f.max_q;
    ctx->saved_data["max_k"] = f.max_k;
    return f.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    AttentionKernelOutput f{
        s[3], s[4], s[5], s[6], s[7], s[8], ctx->saved_data["max_q"].toInt(), ctx->saved_data["max_k"].toInt()};
    auto g = attention_kernel_backward(grads[0].contiguous(), s[0], s[1], s[2], f, ctx->saved_data["scale"].toDouble());
    return {g[0], g[1], g[2], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor op_checkpointed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x) {
  return checkpointed(std::move(fn), x, std::make_shared<Kept>());
}

at::Tensor op_matmul(const at::Tensor& x, const at::Tensor& w) {
  Kept* k = running;
  if (k == nullptr || !CheckpointPolicy::keeps_matmul(++k->matmuls)) return at::linear(x, w);
  if (!k->recompute) {
    at::Tensor y = at::linear(x, w);
    k->outputs.push_back(y);
    return y;
  }
  // As autocast would run the matmul: on its low-precision copies of x and w, which mm's node saves.
  const c10::DeviceType device = x.device().type();
  at::Tensor product = std::move(k->outputs.at(k->next_output++));
  return KeptMatmul::apply(autocast_input(x, device), autocast_input(w, device), std::move(product));
}

at::Tensor op_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                        const std::function<at::Tensor()>& plain) {
  Kept* kept = running;
  if (kept == nullptr || !attention_kernel_available(q.is_cuda(), static_cast<int>(q.element_size()), q.size(3))) {
    return plain();
  }
  if (!kept->recompute) {
    kept->attention.push_back(attention_kernel_forward(q, k, v, scale));
    return kept->attention.back().out;
  }
  // Moved out: the node holds what its backward needs, and nothing else does.
  AttentionKernelOutput f = std::move(kept->attention.at(kept->next_attention++));
  return KeptAttention::apply(q, k, v, scale, f);
}

}  // namespace headroom
