// ActivationOffload — --offload activations: the tensors autograd saves for backward inside each
// layer go to host memory as they are saved, and come back to the device a layer at a time when
// backward needs them.
//
// Forward: each saved tensor's whole storage is copied to the host once per layer (tensors that
// share a storage share the copy; a storage written to in between is copied again); parameters are
// kept as they are. Outside the layers (the embedding, the final norm, the head and the loss)
// nothing moves.
//
// Backward: the first time it unpacks a tensor of layer L, all of L's storages are back on the device
// (copied now unless they already are), and those of the layer below, L − 1, are copied down ahead
// of its backward (prefetched). A layer's device copies go when the last of its saved tensors does,
// after the last node that saved one of them has run. So at most two layers' saved storages are on
// the device: the one backward is in and the one under it.
//
// With checkpointing, a checkpointed layer saves only its input: that is all that moves, as
// torchtune offloads only the checkpoint boundaries.
//
// On the cpu everything is copied at once: the host copies are made under a HostPoolScope
// (memory/host_pool.h), so the budget allocator counts them in its host pool, apart from the
// simulated device. On cuda the host copies are pinned, and both directions run on a copy stream
// beside the compute stream (device/cuda_adapter.h): the copies to the host overlap the forward,
// the prefetch of layer L − 1 overlaps layer L's backward, and the compute stream waits for a
// layer's copies only when it enters it.
#pragma once

#include <ATen/core/Tensor.h>

#include <any>
#include <memory>
#include <unordered_set>
#include <vector>

#include "device/saved_tensor_adapter.h"

namespace headroom {

class CudaCopyStream;

class ActivationOffload : public SavedTensorHooks, public std::enable_shared_from_this<ActivationOffload> {
 public:
  // `parameters`: kept on the device when saved.
  explicit ActivationOffload(const std::vector<at::Tensor>& parameters);
  ~ActivationOffload() override;
  ActivationOffload(const ActivationOffload&) = delete;
  ActivationOffload& operator=(const ActivationOffload&) = delete;

  // A forward begins: its first layer has none below it.
  void start_forward();

  // While a LayerScope lives, what autograd saves on this thread is offloaded; each scope is one
  // layer (copies are shared within it, not across layers), the one below it the scope before it
  // in the same forward.
  class LayerScope {
   public:
    explicit LayerScope(ActivationOffload& owner);
    ~LayerScope();
    LayerScope(const LayerScope&) = delete;
    LayerScope& operator=(const LayerScope&) = delete;

   private:
    ActivationOffload& owner_;
    SavedTensorHooksScope hooks_;
  };

  std::any pack(const at::Tensor& t) override;
  at::Tensor unpack(const std::any& packed) override;

  struct Layer;  // one layer's host copies, and their device copies while backward needs them

 private:
  std::unordered_set<const void*> parameters_;
  std::shared_ptr<Layer> open_;             // the layer being recorded
  std::weak_ptr<Layer> previous_;           // the one recorded before it in this forward
  std::shared_ptr<CudaCopyStream> copies_;  // on cuda, made at the first pack
};

}  // namespace headroom
