#include "model/attention.h"

#include <ATen/ATen.h>

#include <cmath>

#include "device/flash_window_adapter.h"
#include "model/op_checkpoint.h"

namespace headroom {

namespace {

// True where attention is NOT allowed: the future, and (with a window) the too-distant past.
at::Tensor blocked_positions(int64_t t, std::optional<int64_t> window, const at::Device& device) {
  auto pos = at::arange(t, at::TensorOptions().dtype(at::kLong).device(device));
  auto diff = pos.unsqueeze(1) - pos.unsqueeze(0);  // query - key
  auto blocked = diff < 0;
  if (window) blocked = blocked | (diff >= *window);
  return blocked;
}

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, AttentionPath path,
                            double dropout_p, std::optional<int64_t> sliding_window, std::optional<double> scale_in) {
  const int64_t t = q.size(2);
  const int64_t groups = q.size(1) / k.size(1);
  const bool windowed = sliding_window && *sliding_window < t;
  const double scale = scale_in.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));

  if (path == AttentionPath::flash) {
    // cuda, 2-byte: FlashAttention's own window, no mask (device/flash_window_adapter.h).
    if (windowed && windowed_flash_available(q)) {
      return windowed_flash_attention(q, k, v, *sliding_window, scale, dropout_p);
    }
    if (!windowed) {
      auto sdpa = [&] {
        return at::scaled_dot_product_attention(q, k, v, {}, dropout_p, /*is_causal=*/true, scale,
                                                /*enable_gqa=*/groups > 1);
      };
      // Per-op checkpointing keeps the fused kernel's output (model/op_checkpoint.h).
      return dropout_p == 0 ? op_attention(q, k, v, scale, sdpa) : sdpa();
    }
    auto allowed = blocked_positions(t, sliding_window, q.device()).logical_not();
    return at::scaled_dot_product_attention(q, k, v, allowed, dropout_p, /*is_causal=*/false, scale,
                                            /*enable_gqa=*/groups > 1);
  }

  at::Tensor kk = groups > 1 ? k.repeat_interleave(groups, 1) : k;
  at::Tensor vv = groups > 1 ? v.repeat_interleave(groups, 1) : v;
  auto scores = at::matmul(q, kk.transpose(-2, -1)) * scale;
  scores = scores.masked_fill(blocked_positions(t, windowed ? sliding_window : std::nullopt, q.device()),
                              -std::numeric_limits<double>::infinity());
  auto probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  if (dropout_p > 0) probs = at::dropout(probs, dropout_p, /*train=*/true);
  return at::matmul(probs, vv);
}

}  // namespace headroom
