// The one adapter over FlashAttention-2's own sliding window (at::_flash_attention_forward, a private
// ATen operator with its own autograd): sliding-window attention on cuda without a seq × seq mask.
// scaled_dot_product_attention takes a window only as a mask, which rules its flash kernel out and
// makes the mask itself seq² bytes; this kernel skips the out-of-window blocks instead.
//
// Compiled on every build; usable only where available() says so (a cuda tensor in fp16 or bf16,
// head dim a multiple of 8 up to 256), which never holds on a machine without a GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace headroom {

// q: [B, H, T, D]; k, v: [B, Hkv, T, D].
bool windowed_flash_available(const at::Tensor& q);

// Causal attention where position t sees (t - window, t]; returns [B, H, T, D] (a transposed view of
// the kernel's [B, T, H, D] output). Only where windowed_flash_available(q).
at::Tensor windowed_flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window,
                                    double scale, double dropout_p);

}  // namespace headroom
