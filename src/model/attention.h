// Causal self-attention over already-projected heads, by one of two paths.
//
// flash: at::scaled_dot_product_attention, which picks a fused kernel and never materialises the
//        T x T score matrix when it can avoid it. A sliding window is a T x T mask for it, except on
//        cuda in fp16/bf16, where FlashAttention's own window (device/flash_window_adapter.h) needs
//        none.
// math:  the textbook path — scores = q k^T / sqrt(d), mask, softmax in float32, dropout, times v —
//        which holds the B x H x T x T scores (and probabilities) for backward. The difference in
//        memory between the two is one of the things headroom measures and explains.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "config/attention_path.h"

namespace headroom {

// q: [B, H, T, D]; k, v: [B, Hkv, T, D] with H a multiple of Hkv (grouped-query attention).
// A sliding window w lets position t see positions (t-w, t]. `scale` multiplies q·kᵀ (default
// 1/sqrt(D)). Returns [B, H, T, D].
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, AttentionPath path,
                            double dropout_p, std::optional<int64_t> sliding_window,
                            std::optional<double> scale = std::nullopt);

}  // namespace headroom
