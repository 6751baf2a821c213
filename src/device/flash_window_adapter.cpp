#include "device/flash_window_adapter.h"

#include <ATen/ATen.h>

namespace headroom {

bool windowed_flash_available(const at::Tensor& q) {
  const int64_t d = q.size(-1);
  return q.is_cuda() && (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) && d % 8 == 0 && d <= 256;
}

at::Tensor windowed_flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window,
                                    double scale, double dropout_p) {
  const int64_t t = q.size(2);
  // The kernel takes [B, T, H, D] (the projections' own layout: these transposes are views) and
  // keys and values with fewer heads (grouped-query) as they are. Its window is inclusive on the
  // left: `window - 1` earlier positions, none later.
  auto out = at::_flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), std::nullopt,
                                          std::nullopt, t, t, dropout_p, /*is_causal=*/true,
                                          /*return_debug_mask=*/false, scale, window - 1, /*window_size_right=*/0);
  return std::get<0>(out).transpose(1, 2);
}

}  // namespace headroom
