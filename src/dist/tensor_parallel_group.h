// TensorParallelGroup — what a training step does differently when each layer's matrices are split
// over T ranks (lever 6, model parallelism; the model's side is model/tensor_parallel.h), over a
// Communicator of those ranks.
//
// The forward's and backward's sums run inside the model's autograd graph, through the TensorSlice
// this hands the model. What is left for the step: the global gradient norm (clipping), summed over
// the ranks with each parameter counted once — a replicated one (a norm, a bias after the sum, a
// key/value head held by several ranks) by its share on each — and fp16's inf/NaN check, agreed over
// the ranks, so that they all skip the same steps. Not thread-safe; one per run.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "dist/communicator.h"
#include "model/causal_lm.h"
#include "model/tensor_parallel.h"
#include "util/named_tensor.h"

namespace headroom {

class TensorParallelGroup {
 public:
  // `comm`: the ranks that split the layers, rank t holding share t; `sequence`: sequence parallel.
  TensorParallelGroup(Communicator& comm, bool sequence);
  TensorParallelGroup(const TensorParallelGroup&) = delete;
  TensorParallelGroup& operator=(const TensorParallelGroup&) = delete;

  int rank() const { return comm_.rank(); }
  int ranks() const { return comm_.size(); }
  Communicator& comm() { return comm_; }
  // This rank's share, with the collective bound to `comm` (lives as long as this object).
  const TensorSlice& slice() const { return slice_; }

  // Clips the global gradient norm to max_norm (<= 0: no clipping); the norm before. `params`: what
  // the optimizer updates (the model's parameters, or data parallel's slices of them, by the same
  // names); `model` says how many ranks hold a copy of each. `data_sum`, when given, sums the squares
  // over the data-parallel ranks first (each holds a slice of the gradients).
  double clip_grad_norm(const std::vector<NamedTensor>& params, const CausalLM& model, double max_norm,
                        const std::function<void(at::Tensor&)>& data_sum = {});
  bool any(bool flag);
  // What the norm counts of the named parameter's gradient on each rank: 1 / the ranks holding it.
  static double share(const CausalLM& model, const std::string& name);

 private:
  Communicator& comm_;
  TensorSlice slice_;
};

}  // namespace headroom
