// The one adapter over autograd's saved-variable hooks for a C++ process (torch::autograd::Engine's
// default hooks, not a public API): what Python's torch.autograd.graph.saved_tensors_hooks does.
// While a SavedTensorHooksScope is alive on a thread, every tensor autograd saves for backward on
// that thread goes through the hooks' pack, and backward gets it back through unpack.
//
// C++ has no default hooks of its own: the engine asks its default engine for them, which in a
// Python process is Python's. The first scope installs an engine of headroom's as the default (in a
// process whose default engine is still LibTorch's base engine; anywhere else it is an Error).
#pragma once

#include <ATen/core/Tensor.h>

#include <any>
#include <memory>

namespace headroom {

class SavedTensorHooks {
 public:
  virtual ~SavedTensorHooks() = default;
  // Called when autograd saves `t`; what it returns is all the saved variable keeps.
  virtual std::any pack(const at::Tensor& t) = 0;
  // Called when backward needs the tensor back, with what pack returned.
  virtual at::Tensor unpack(const std::any& packed) = 0;
};

// Whether scopes can be opened in this process (false inside Python, whose engine is installed).
bool saved_tensor_hooks_available();

class SavedTensorHooksScope {
 public:
  // Throws Error where saved_tensor_hooks_available() is false.
  explicit SavedTensorHooksScope(std::shared_ptr<SavedTensorHooks> hooks);
  ~SavedTensorHooksScope();
  SavedTensorHooksScope(const SavedTensorHooksScope&) = delete;
  SavedTensorHooksScope& operator=(const SavedTensorHooksScope&) = delete;

 private:
  std::shared_ptr<SavedTensorHooks> previous_;
};

}  // namespace headroom
