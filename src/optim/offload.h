// Optimizer offload — the optimizer's state and its update in host memory (lever 8's offload, as
// torchao's CPUOffloadOptimizer and DeepSpeed's ZeRO-Offload keep them).
//
// Each trainable parameter gets a host copy and a host gradient buffer, and an optimizer of the
// run's kind of its own over the host copy, so the device holds the parameters and gradients only.
// A step copies each gradient to the host, updates the host copy there, and copies it back into the
// device parameter. A host copy is refreshed from its parameter first when the parameter changed
// since the last copy back (a checkpoint loaded into it: at::Tensor's version counter says so).
//   cpu (the simulated device): the host tensors are allocated in the budget allocator's host pool
//       (memory/host_pool.h), apart from the device's and outside its budget.
//   cuda: they are pinned, and the copies run on a side stream (device/cuda_adapter.h's
//       CudaCopyStream): the host updates one parameter while the next gradients are copied down
//       and the updated parameters copied back.
// state() is the host optimizers' state under the usual names, so checkpoints are the same as
// without offload. Not with data-parallel sharding (OptimizerOptions::sharding): an Error.
#pragma once

#include <memory>
#include <vector>

#include "optim/optimizer.h"

namespace headroom {

std::unique_ptr<Optimizer> make_offloaded_optimizer(OptimizerKind kind, const std::vector<NamedTensor>& params,
                                                    const OptimizerOptions& options);

}  // namespace headroom
