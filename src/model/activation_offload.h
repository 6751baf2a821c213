// ActivationOffload — --offload activations: the tensors autograd saves for backward inside each
// layer go to host memory as they are saved, and come back to the device when backward needs them.
//
// Each saved tensor's whole storage is copied to the host once per layer (tensors that share a
// storage share the copy; a storage written to in between is copied again); parameters are kept
// as they are. Backward copies a storage back for each saved tensor a node unpacks, and the copy is
// freed when the node has run: at most the running node's saved tensors are on the device.
// Outside the layers (the embedding, the final norm, the head and the loss) nothing moves.
//
// With checkpointing, a checkpointed layer saves only its input: that is all that moves, as
// torchtune offloads only the checkpoint boundaries. On the cpu the host copies are made under a
// HostPoolScope (memory/host_pool.h): the budget allocator counts them in its host pool, apart from
// the simulated device. On cuda they are pinned, and the copies synchronous (prefetch on a side
// stream is not built yet).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "device/saved_tensor_adapter.h"

namespace headroom {

class ActivationOffload : public SavedTensorHooks, public std::enable_shared_from_this<ActivationOffload> {
 public:
  // `parameters`: kept on the device when saved.
  explicit ActivationOffload(const std::vector<at::Tensor>& parameters);

  // While a LayerScope lives, what autograd saves on this thread is offloaded; each scope is one
  // layer (copies are shared within it, not across layers).
  class LayerScope {
   public:
    explicit LayerScope(ActivationOffload& owner) : owner_(owner), hooks_(owner.shared_from_this()) {}
    ~LayerScope() { owner_.layer_copies_.clear(); }
    LayerScope(const LayerScope&) = delete;
    LayerScope& operator=(const LayerScope&) = delete;

   private:
    ActivationOffload& owner_;
    SavedTensorHooksScope hooks_;
  };

  std::any pack(const at::Tensor& t) override;
  at::Tensor unpack(const std::any& packed) override;

 private:
  struct HostCopy;
  std::unordered_set<const void*> parameters_;
  std::unordered_map<const void*, std::shared_ptr<HostCopy>> layer_copies_;
};

}  // namespace headroom
