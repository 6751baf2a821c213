// The one adapter over autograd's post-accumulate-grad hooks (torch::autograd::impl, not a public
// API): a function that runs each time backward has accumulated a leaf's gradient into .grad.
// ZeRO-2 (dist/data_parallel.h) uses it to reduce a parameter's gradient as soon as it is complete
// and release it, so that a rank never holds the whole model's gradients.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

namespace headroom {

// Replaces the leaf's hook (a leaf has one slot); the function receives the leaf, whose .grad is set.
void set_gradient_accumulated_hook(const at::Tensor& leaf, std::function<void(const at::Tensor&)> hook);
void clear_gradient_accumulated_hook(const at::Tensor& leaf);

}  // namespace headroom
