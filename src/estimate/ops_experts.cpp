// model/experts.cpp's mixture of experts in estimate/ops.h: the routing, the sort that groups the
// tokens by expert, each expert's gated MLP, and the weighted scatter back.
#include "estimate/ops.h"

namespace headroom::sim {

Ops::ExpertLabels Ops::expert_labels() {
  return ExpertLabels{
      act("router logits", "router logits and float32 probabilities, B·T·experts each"),
      act("top-k weights and indices",
          "B·T·top_k routing weights (float32 and cast) and int64 "
          "indices, and the int64 order that groups them by expert"),
      act("expert gather buffers", "the tokens gathered by expert, B·T·top_k·hidden"),
      act("expert activations", "gate, up and their product per expert, B·T·top_k·moe_intermediate each"),
      act("expert scatter buffers",
          "the experts' outputs joined and weighted, B·T·top_k·hidden, summed into B·T·hidden"),
  };
}

Ops::Routing Ops::route(const Tensor& flat, const Param& router, int64_t count, int64_t top_k, bool normalise,
                        bool stats, int aux_label, const ExpertLabels& l) {
  const int64_t rows = flat.numel / router.cols, picks = rows * top_k;
  Tensor logits = linear(flat, router, nullptr, l.logits);
  const int e = logits.elem;
  // softmax(dtype=float32): a 2-byte input is converted first; softmax keeps its output.
  Tensor converted = cast(logits, 4, tmp_);
  Tensor probs = make(rows * count, 4, l.logits, converted.requires_grad());
  g_->record({&probs}, {probs.buf},
             [this, in = meta(converted)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(in)}; });
  converted = logits = Tensor{};
  // topk: the values, and the indices it keeps; backward scatters into zeros of the input's size.
  Tensor top = make(picks, 4, l.topk, probs.requires_grad());
  Ref indices = mem_.allocate(picks * 8, l.topk);
  g_->record({&top}, {indices},
             [this, probs = meta(probs)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(probs)}; });
  if (normalise) {
    Tensor sum = make(rows, 4, tmp_, top.requires_grad());
    // sum's backward expands its gradient: a view, which the engine adds out of place.
    g_->record({&sum}, {}, [top = meta(top)](const std::vector<Ref>& in) {
      return std::vector<Emit>{Emit{top.slot, in[0], true}};
    });
    Tensor divided = make(picks, 4, l.topk, top.requires_grad());
    g_->record({&divided}, {top.buf, sum.buf}, [this, top = meta(top), sum = meta(sum)](const std::vector<Ref>&) {
      Emit self = grad_to(top);
      Ref a = g_->scratch(top.bytes()), b = g_->scratch(top.bytes());  // -grad · self / other²
      return std::vector<Emit>{self, grad_to(sum)};
    });
    top = divided;
  }
  Tensor weights = cast(top, e, l.topk);
  top = Tensor{};
  if (stats) {
    // bincount of the choices (int64), as float32; the probabilities summed per expert.
    { Ref counted = mem_.allocate(count * 8, tmp_); }
    Ref assigned = mem_.allocate(count * 4, aux_label);
    Tensor summed = make(count, 4, aux_label, probs.requires_grad());
    g_->record({&summed}, {}, [probs = meta(probs)](const std::vector<Ref>& in) {
      return std::vector<Emit>{Emit{probs.slot, in[0], true}};
    });
    aux_.push_back(summed);
    aux_refs_.push_back(assigned);
  }
  return Routing{std::move(weights), std::move(indices)};
}

Tensor Ops::run_experts(Tensor gathered, int64_t d, const std::vector<ExpertWeights>& experts,
                        const std::vector<int64_t>& loads, bool gate_relu, int out_elem, const ExpertLabels& l) {
  std::vector<Tensor> pieces;
  std::vector<const Tensor*> piece_ptrs;
  pieces.reserve(experts.size());
  for (int64_t load : loads) pieces.push_back(g_->alias(gathered, load * d));
  for (const Tensor& t : pieces) piece_ptrs.push_back(&t);
  // split's backward: one concatenation of the pieces' gradients.
  g_->record(piece_ptrs, {}, [this, gathered = meta(gathered)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(gathered)};
  });
  const int64_t joined_numel = gathered.numel;
  gathered = Tensor{};
  std::vector<Tensor> outputs;
  outputs.reserve(experts.size());
  for (size_t i = 0; i < experts.size(); ++i) {
    Tensor gate = activation(linear(pieces[i], *experts[i].gate, nullptr, l.mlp), gate_relu);
    Tensor up = linear(pieces[i], *experts[i].up, nullptr, l.mlp);
    Tensor h = mul(gate, up, l.mlp);
    gate = up = Tensor{};
    outputs.push_back(linear(h, *experts[i].down, nullptr, l.scatter));
  }
  pieces.clear();
  if (!outputs.empty()) out_elem = outputs.front().elem;
  bool any_output_grad = false;
  for (const Tensor& o : outputs) any_output_grad |= o.requires_grad();
  Tensor joined = make(joined_numel, out_elem, l.scatter, any_output_grad);
  std::vector<SlotPtr> slots;
  for (const Tensor& o : outputs) slots.push_back(o.slot);
  g_->record({&joined}, {}, [slots](const std::vector<Ref>& in) {
    std::vector<Emit> out;
    for (const SlotPtr& s : slots) out.push_back(Emit{s, in[0], true});  // narrow views of the gradient
    return out;
  });
  return joined;
}

Tensor Ops::mixture_of_experts(const Tensor& x, const Param& router, const std::vector<ExpertWeights>& experts,
                               int64_t top_k, bool normalise, const std::vector<int64_t>& loads, bool gate_relu,
                               bool stats, int aux_label) {
  const int64_t count = static_cast<int64_t>(experts.size()), d = router.cols, rows = x.numel / d;
  const int64_t picks = rows * top_k;
  const ExpertLabels l = expert_labels();
  Tensor flat = view(x);
  // The top-k indices are held to the end, as the real function's local holds them.
  auto [weights, indices] = route(flat, router, count, top_k, normalise, stats, aux_label, l);
  const int e = weights.elem;
  // Without gradients: the stable sort's values and order, each token's row, the loads.
  Ref order, token;
  {
    Ref values = mem_.allocate(picks * 8, tmp_);
    order = mem_.allocate(picks * 8, l.topk);
    token = mem_.allocate(picks * 8, l.topk);
    values.reset();
  }
  Ref sizes = mem_.allocate(count * 8, tmp_);
  Tensor gathered = make(picks * d, flat.elem, l.gather, flat.requires_grad());
  g_->record({&gathered}, {token}, [this, flat = meta(flat)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(flat)};  // zeros of the input's size, index_add
  });
  Tensor weight = make(picks, weights.elem, l.topk, weights.requires_grad());
  g_->record({&weight}, {order},
             [this, w = meta(weights)](const std::vector<Ref>&) { return std::vector<Emit>{grad_to(w)}; });
  weights = Tensor{};
  Tensor joined = run_experts(std::move(gathered), d, experts, loads, gate_relu, e, l);
  Tensor weighted = mul(joined, weight, l.scatter);
  joined = weight = Tensor{};
  // zeros [tokens, hidden], index_add_ in place: backward selects the gradient's rows (its formula
  // keeps the source, for its shape).
  Tensor out = make(rows * d, weighted.elem, l.scatter, weighted.requires_grad());
  g_->record({&out}, {token, weighted.buf}, [this, weighted = meta(weighted)](const std::vector<Ref>&) {
    return std::vector<Emit>{grad_to(weighted)};
  });
  return view(out);
}

}  // namespace headroom::sim
