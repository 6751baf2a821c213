// NamedTensor — a tensor with a stable name ("layers.0.attn.q_proj.weight", "<param>.exp_avg"), as
// models, optimizers and checkpoints exchange them.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace headroom {

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

}  // namespace headroom
