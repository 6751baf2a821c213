#include "device/saved_tensor_adapter.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <mutex>

#include "util/error.h"

namespace headroom {
namespace {

thread_local std::shared_ptr<SavedTensorHooks> active_hooks;

// One saved variable's hooks: what pack kept, and the hooks to unpack it with.
class Bridge : public torch::autograd::SavedVariableHooks {
 public:
  explicit Bridge(std::shared_ptr<SavedTensorHooks> hooks) : hooks_(std::move(hooks)) {}
  void call_pack_hook(const at::Tensor& tensor) override { packed_ = hooks_->pack(tensor); }
  at::Tensor call_unpack_hook() override { return hooks_->unpack(packed_); }

 private:
  std::shared_ptr<SavedTensorHooks> hooks_;
  std::any packed_;
};

// LibTorch's engine, answering the saved variables' question for default hooks with the active
// scope's.
struct HookingEngine : torch::autograd::Engine {
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (!active_hooks) return nullptr;
    return std::make_unique<Bridge>(active_hooks);
  }
};

torch::autograd::Engine& hooking_engine() {
  static HookingEngine engine;
  return engine;
}

bool install() {
  static std::once_flag once;
  static bool installed = false;
  std::call_once(once, [] {
    auto& current = torch::autograd::Engine::get_default_engine();
    if (&current != &torch::autograd::Engine::get_base_engine()) return;  // Python's, or another's
    torch::autograd::set_default_engine_stub(&hooking_engine);
    installed = true;
  });
  return installed;
}

}  // namespace

bool saved_tensor_hooks_available() { return install(); }

SavedTensorHooksScope::SavedTensorHooksScope(std::shared_ptr<SavedTensorHooks> hooks) {
  if (!install()) {
    fail("saved-tensor hooks from C++ need LibTorch's own autograd engine, and this process has another (Python's); "
         "in Python use headroom.offload_activations()");
  }
  previous_ = std::exchange(active_hooks, std::move(hooks));
}

SavedTensorHooksScope::~SavedTensorHooksScope() { active_hooks = std::move(previous_); }

}  // namespace headroom
