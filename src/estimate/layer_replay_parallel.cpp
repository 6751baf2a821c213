// LayerReplay's tensor- and sequence-parallel pieces (model/tensor_parallel.h on the simulation):
// the row-parallel projection's sum, and sequence parallel's gather and scatter of the tokens with
// the collectives' own buffers on Gloo.
#include "estimate/layer_replay.h"

namespace headroom::replay {

using sim::Category;
using sim::Emit;
using sim::Param;
using sim::Ref;
using sim::Tensor;

Tensor LayerReplay::project_out(const Tensor& x, const std::string& weight, const Param* bias, int label) {
  // Tensor parallel: the partial product summed over the ranks (in place; sequence parallel: into
  // this rank's part), then the bias added.
  if (stage_.tensor.whole()) return project(x, weight, bias, label);
  Tensor y = project(x, weight, nullptr, label);
  if (stage_.tensor.splits_sequence()) y = scatter_sequence(y);
  return bias == nullptr ? y : add(y, bias->t, label);
}

Tensor LayerReplay::gather_sequence(const Tensor& part) {
  const int64_t ranks = stage_.tensor.ranks;
  const int comm = mem_.label("tensor-parallel collectives", Category::communication,
                              "sequence parallel on Gloo: the all-gather's flat result and the reduce-scatter's "
                              "flat copy of its input, while each runs");
  const int lbl = act("gathered tokens", "sequence parallel: a block's normed input all-gathered, B·T·hidden");
  Tensor whole = make(part.numel * ranks, part.elem, lbl, part.requires_grad());
  if (!s_.cuda) Ref flat = mem_.allocate(whole.bytes(), comm);  // Gloo gathers into its own, then copies out
  g_->record({&whole}, {}, [this, part = meta(part), ranks, comm](const std::vector<Ref>&) {
    Emit e = grad_to(part);
    if (!s_.cuda) Ref copy = mem_.allocate(part.bytes() * ranks, comm);  // Gloo reduces a flat copy
    return std::vector<Emit>{e};
  });
  return whole;
}

Tensor LayerReplay::scatter_sequence(const Tensor& partial) {
  const int64_t ranks = stage_.tensor.ranks;
  const int comm = mem_.label("tensor-parallel collectives", Category::communication, "");
  const int lbl = act("residual stream", "block outputs and residual sums, B·T·hidden each");
  Tensor part = make(partial.numel / ranks, partial.elem, lbl, partial.requires_grad());
  if (!s_.cuda) Ref copy = mem_.allocate(partial.bytes(), comm);
  g_->record({&part}, {}, [this, partial = meta(partial), comm](const std::vector<Ref>&) {
    Emit e = grad_to(partial);
    if (!s_.cuda) Ref flat = mem_.allocate(partial.bytes(), comm);
    return std::vector<Emit>{e};
  });
  return part;
}

}  // namespace headroom::replay
