// The one adapter over the fused attention kernels' own forward and backward operators (private
// ATen operators): at::_scaled_dot_product_flash_attention_for_cpu and its _backward on cpu, and
// at::_scaled_dot_product_flash_attention and its _backward on cuda. scaled_dot_product_attention
// runs the same kernels but hides what their backward needs (the log-sum-exp, cuda's random state);
// per-op checkpointing (model/op_checkpoint.h) keeps the kernel's output from the forward and
// backpropagates through it later without running the kernel again, which needs both halves.
//
// Causal attention only, without a mask or dropout. Compiled on every build; the cuda half is
// usable only where available() says so, which never holds on a machine without a GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>

namespace headroom {

// Whether the kernel with a callable backward runs causal attention of queries of this kind: on cpu
// any floating dtype; on cuda FlashAttention's fp16 or bf16 with a head dim a multiple of 8 up to
// 256. The estimator asks it too (estimate/ops.h), so both agree on what is kept.
bool attention_kernel_available(bool cuda, int element_bytes, int64_t head_dim);

// What the kernel's forward returns and its backward needs.
struct AttentionKernelOutput {
  at::Tensor out;                                      // [B, H, T, D], the query's layout
  at::Tensor logsumexp;                                // float32, [B, H, T]
  at::Tensor cum_seq_q, cum_seq_k, rng_state, unused;  // cuda only
  int64_t max_q = 0, max_k = 0;                        // cuda only
};

// q: [B, H, T, D]; k, v: [B, Hkv, T, D] with H a multiple of Hkv (grouped-query attention, which
// both kernels take as it is). Causal; `scale` multiplies q·kᵀ. Only where available().
AttentionKernelOutput attention_kernel_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               double scale);
// The gradients of q, k and v for the output's gradient `grad`.
std::array<at::Tensor, 3> attention_kernel_backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const AttentionKernelOutput& fwd,
                                                    double scale);

}  // namespace headroom
