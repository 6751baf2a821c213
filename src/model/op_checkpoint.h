// Per-op selective activation checkpointing (--checkpointing ops, config/checkpoint_policy.h): the
// policy torchtitan applies by default through PyTorch's create_selective_checkpoint_contexts.
//
// op_checkpointed(fn, x) runs a layer's forward without recording, as checkpointed() does
// (model/checkpointing.h), but keeps the outputs of the operators the policy saves: the 1st, 3rd,
// 5th ... matrix multiplication of the layer (op_matmul: a projection without bias, aten::mm) and
// the fused attention kernel's output with its log-sum-exp (op_attention). Backward runs fn again
// under the forward's random and autocast state; those operators do not run again there: each
// hands back its kept output with an autograd node whose backward is the operator's own (mm's two
// products; the attention kernel's backward), so the recomputed graph is the one the forward would
// have recorded. Everything else is recomputed. Matmuls are counted per call of fn, forward and
// recompute alike, as torchtitan's policy counts them.
//
// Outside op_checkpointed, op_matmul and op_attention are the plain operators. Not for LoRA, NF4
// or a mixture of experts (their matmuls are not counted here; run_config refuses them).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

namespace headroom {

// y = fn(x), the policy's operators kept, the rest recomputed in backward. `fn` must be a pure
// function of x and of tensors that outlive backward (parameters). When x needs no gradient fn
// runs plainly.
at::Tensor op_checkpointed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x);

// at::linear(x, w) without bias (aten::mm).
at::Tensor op_matmul(const at::Tensor& x, const at::Tensor& w);

// Causal attention of q [B, H, T, D] and k, v [B, Hkv, T, D] with scale `scale` and no mask or
// dropout: inside op_checkpointed through the kernel of device/attention_kernel_adapter.h where it
// is available (kept), else `plain()` (recomputed).
at::Tensor op_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                        const std::function<at::Tensor()>& plain);

}  // namespace headroom
