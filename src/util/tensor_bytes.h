// Bytes held by a set of tensors, each storage counted once (views and tied weights share one).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace headroom {

// Undefined tensors and tensors without storage count zero.
int64_t storage_bytes(const std::vector<at::Tensor>& tensors);

}  // namespace headroom
