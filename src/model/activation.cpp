#include "model/activation.h"

#include <ATen/ATen.h>

namespace headroom {

at::Tensor activate(const at::Tensor& x, Activation a) {
  switch (a) {
    case Activation::gelu: return at::gelu(x);
    case Activation::gelu_tanh: return at::gelu(x, "tanh");
    case Activation::silu: return at::silu(x);
    case Activation::relu: return at::relu(x);
  }
  return x;
}

}  // namespace headroom
