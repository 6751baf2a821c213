// ParameterGate — lets a model whose weights are kept elsewhere (ZeRO-3: each rank holds a slice of
// every parameter, dist/data_parallel.h) have a unit's parameters in place exactly while it uses them.
//
// The model's parameters are grouped in units: unit 0 is the embeddings, the final norm and the head
// (a tied head is the embedding), unit 1 + i is layer i (CausalLM::parameter_units()). The forward
// asks for a unit before running it and says when it is done; through gate_backward() it asks for a
// layer again just before autograd backpropagates through it. When to let a unit go after backward
// is the gate's own business (it sees the gradients arrive).
#pragma once

#include <ATen/core/Tensor.h>

namespace headroom {

class ParameterGate {
 public:
  virtual ~ParameterGate() = default;
  // The unit's parameters hold their values from now on (a no-op when they already do).
  virtual void gather(int unit) = 0;
  // The forward has finished with the unit (it may still be needed by backward: the gate decides).
  virtual void forward_done(int unit) = 0;
};

// x unchanged; when backward reaches it, gate->gather(unit) is called before the gradient flows on
// into the ops that produced x. Plain x when gradients are not being recorded.
at::Tensor gate_backward(const at::Tensor& x, ParameterGate* gate, int unit);

}  // namespace headroom
