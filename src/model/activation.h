// The MLP activations of the families (config/model_config.h's Activation), one function for the
// dense MLP and the experts alike.
#pragma once

#include <ATen/core/Tensor.h>

#include "config/model_config.h"

namespace headroom {

at::Tensor activate(const at::Tensor& x, Activation a);

}  // namespace headroom
