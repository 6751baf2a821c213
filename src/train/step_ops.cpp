#include "train/step_ops.h"

#include <ATen/ATen.h>

namespace headroom {

void seed_step(uint64_t seed, int64_t step, int rank) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step) + 1 +
               static_cast<uint64_t>(rank) * 0xD1B54A32D192ED03ull;
  x = (x ^ (x >> 31)) * 0xBF58476D1CE4E5B9ull;
  at::manual_seed(x >> 1);
}

at::Tensor token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}));
}

}  // namespace headroom
