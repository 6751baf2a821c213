#include "model/chunked_loss.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "device/autocast_adapter.h"
#include "util/error.h"

namespace headroom {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A chunk's logits in float32: the matmul in the compute dtype, then the upcast (none in float32).
at::Tensor chunk_logits(const at::Tensor& hc, const at::Tensor& wc) {
  at::Tensor logits = at::mm(hc, wc.t());
  return logits.scalar_type() == at::kFloat ? logits : logits.to(at::kFloat);
}

struct ChunkedLoss : public torch::autograd::Function<ChunkedLoss> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk) {
    const AutocastState autocast = autocast_state(hidden.device().type());
    const c10::ScalarType compute = autocast.enabled ? autocast.dtype : hidden.scalar_type();
    const AutocastScope plain(hidden.device().type(), AutocastState{false, autocast.dtype});
    const int64_t n = hidden.size(0);
    // What the head's matmul would keep: the hidden states in the compute dtype.
    const at::Tensor hc = hidden.to(compute);
    at::Tensor wc = weight.to(compute);
    const at::Tensor lse = at::empty({n}, hidden.options().dtype(at::kFloat));
    const at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    for (int64_t s = 0; s < n; s += chunk) {
      const int64_t rows = std::min(chunk, n - s);
      at::Tensor lf = chunk_logits(hc.narrow(0, s, rows), wc);
      const at::Tensor picked = lf.gather(1, targets.narrow(0, s, rows).unsqueeze(1));
      const at::Tensor top = lf.amax({1}, /*keepdim=*/true);
      lf.sub_(top).exp_();
      at::Tensor chunk_lse = lf.sum({1}, /*keepdim=*/true);
      lf.reset();
      chunk_lse.log_().add_(top);
      lse.narrow(0, s, rows).copy_(chunk_lse.squeeze(1));
      total.add_((chunk_lse - picked).sum());
    }
    wc.reset();
    ctx->save_for_backward({hc, weight, targets, lse});
    ctx->saved_data["hidden_dtype"] = static_cast<int64_t>(hidden.scalar_type());
    ctx->saved_data["chunk"] = chunk;
    return total / static_cast<double>(n);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& hc = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& targets = saved[2];
    const at::Tensor& lse = saved[3];
    const auto hidden_dtype = static_cast<c10::ScalarType>(ctx->saved_data["hidden_dtype"].toInt());
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const c10::ScalarType compute = hc.scalar_type();
    const AutocastScope plain(hc.device().type(), AutocastState{false, compute});
    const int64_t n = hc.size(0);
    const bool weight_grad = ctx->needs_input_grad(1);
    at::Tensor wc = weight.to(compute);
    at::Tensor grad_h = at::empty(hc.sizes(), hc.options());
    at::Tensor grad_w = weight_grad ? at::zeros(weight.sizes(), weight.options().dtype(at::kFloat)) : at::Tensor();
    // d(mean loss)/d(logit) = (softmax - one-hot) · g / n.
    const at::Tensor scale = grads[0].to(at::kFloat) / static_cast<double>(n);
    for (int64_t s = 0; s < n; s += chunk) {
      const int64_t rows = std::min(chunk, n - s);
      const at::Tensor h = hc.narrow(0, s, rows);
      const at::Tensor index = targets.narrow(0, s, rows).unsqueeze(1);
      at::Tensor lf = chunk_logits(h, wc);
      lf.sub_(lse.narrow(0, s, rows).unsqueeze(1)).exp_();
      at::Tensor picked = lf.gather(1, index);
      lf.scatter_(1, index, picked.sub_(1));
      picked.reset();
      lf.mul_(scale);
      if (compute == at::kFloat) {
        at::Tensor out = grad_h.narrow(0, s, rows);
        at::mm_out(out, lf, wc);
        if (weight_grad) grad_w.addmm_(lf.t(), h);
        continue;
      }
      at::Tensor low = lf.to(compute);  // the full path's cast of the logits' gradient
      at::Tensor out = grad_h.narrow(0, s, rows);
      at::mm_out(out, low, wc);
      if (weight_grad) {
        lf.copy_(low);  // the rounded values, exactly, for a float32 sum over the chunks
        low.reset();
        grad_w.addmm_(lf.t(), h.to(at::kFloat));
      }
    }
    wc.reset();
    if (weight_grad && compute != at::kFloat) {
      // Rounded once, as one matmul over all tokens in the compute dtype rounds it.
      if (weight.scalar_type() == compute) {
        grad_w = grad_w.to(compute);
      } else {
        grad_w.copy_(grad_w.to(compute));
      }
    }
    if (hidden_dtype != compute) grad_h = grad_h.to(hidden_dtype);
    return {grad_h, grad_w, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunked_token_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                              int64_t chunk) {
  if (chunk <= 0) fail("chunked loss: the chunk must be a positive number of tokens, got {}", chunk);
  const at::Tensor h = hidden.reshape({-1, hidden.size(-1)});
  const at::Tensor t = targets.reshape({-1});
  TORCH_CHECK(h.size(0) == t.size(0), "chunked loss: ", h.size(0), " hidden rows for ", t.size(0), " targets");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == h.size(1), "chunked loss: weight ", weight.sizes(),
              " for hidden states of width ", h.size(1));
  return ChunkedLoss::apply(h, weight, t, chunk);
}

}  // namespace headroom
