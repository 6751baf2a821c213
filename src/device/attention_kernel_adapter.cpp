#include "device/attention_kernel_adapter.h"

#include <ATen/ATen.h>

namespace headroom {

bool attention_kernel_available(bool cuda, int element_bytes, int64_t head_dim) {
  if (!cuda) return true;
  return element_bytes == 2 && head_dim % 8 == 0 && head_dim <= 256;
}

AttentionKernelOutput attention_kernel_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               double scale) {
  AttentionKernelOutput r;
  if (!q.is_cuda()) {
    std::tie(r.out, r.logsumexp) =
        at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, /*is_causal=*/true, std::nullopt, scale);
    return r;
  }
  auto f =
      at::_scaled_dot_product_flash_attention(q, k, v, 0.0, /*is_causal=*/true, /*return_debug_mask=*/false, scale);
  r.out = std::get<0>(f);
  r.logsumexp = std::get<1>(f);
  r.cum_seq_q = std::get<2>(f);
  r.cum_seq_k = std::get<3>(f);
  r.max_q = std::get<4>(f).expect_int();
  r.max_k = std::get<5>(f).expect_int();
  r.rng_state = std::get<6>(f);
  r.unused = std::get<7>(f);
  return r;
}

std::array<at::Tensor, 3> attention_kernel_backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const AttentionKernelOutput& f, double scale) {
  std::tuple<at::Tensor, at::Tensor, at::Tensor> g;
  if (!q.is_cuda()) {
    g = at::_scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, f.out, f.logsumexp, 0.0,
                                                                 /*is_causal=*/true, std::nullopt, scale);
  } else {
    g = at::_scaled_dot_product_flash_attention_backward(grad, q, k, v, f.out, f.logsumexp, f.cum_seq_q, f.cum_seq_k,
                                                         f.max_q, f.max_k, 0.0, /*is_causal=*/true, f.rng_state,
                                                         f.unused, scale);
  }
  return {std::get<0>(g), std::get<1>(g), std::get<2>(g)};
}

}  // namespace headroom
