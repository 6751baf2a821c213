#include "model/parameter_gate.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

namespace headroom {
namespace {

struct GateUnit : torch::CustomClassHolder {
  ParameterGate* gate = nullptr;
  int unit = 0;
};

// Identity whose backward gathers a unit first. The output is the input itself (autograd makes it a
// view of it), so no activation-sized copy is made.
struct GateBackward : public torch::autograd::Function<GateBackward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                c10::intrusive_ptr<GateUnit> unit) {
    ctx->saved_data["unit"] = c10::IValue::make_capsule(std::move(unit));
    return {x};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto unit = c10::static_intrusive_pointer_cast<GateUnit>(ctx->saved_data["unit"].toCapsule());
    unit->gate->gather(unit->unit);
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

at::Tensor gate_backward(const at::Tensor& x, ParameterGate* gate, int unit) {
  if (gate == nullptr || !x.requires_grad() || !c10::GradMode::is_enabled()) return x;
  auto holder = c10::make_intrusive<GateUnit>();
  holder->gate = gate;
  holder->unit = unit;
  return GateBackward::apply(x, holder)[0];
}

}  // namespace headroom
