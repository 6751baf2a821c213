#include "estimate/optimizer_replay.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "optim/offload.h"
#include "optim/optimizer.h"

namespace headroom::replay {

using sim::Category;
using sim::Ref;

OptimizerReplay::OptimizerReplay(sim::Memory& memory, const TrainSpec& s, const std::map<std::string, sim::Param>& params,
                                 const std::vector<std::string>& order, const DataParallelReplay& dp, int ew)
    : mem_(memory), s_(s), params_(params), order_(order), dp_(dp), ew_(ew) {}

std::string OptimizerReplay::state_formula() const {
  std::string formula;
  const std::string per = fmt::format("{} B", ew_);
  switch (s_.optimizer) {
    case OptimizerKind::sgd: formula = "none"; break;
    case OptimizerKind::momentum: formula = "momentum buffer: parameters × " + per; break;
    case OptimizerKind::adam:
    case OptimizerKind::adamw:
      formula = "two moments: 2 × parameters × " + per + ", and a step counter per tensor";
      break;
    case OptimizerKind::adagrad:
      formula = "sum of squares: parameters × " + per + ", and a step counter per tensor";
      break;
    case OptimizerKind::adafactor:
      formula = "float32 row and column second moments per matrix, full ones per vector, step counters";
      break;
    case OptimizerKind::adamw8bit:
      formula = "two 8-bit moments: 2 B per element and a float32 absmax each per block of 2048 (float32 "
                "moments, 8 B, under 4096 elements), a step counter per tensor";
      break;
  }
  if (offloaded()) formula += ", in host memory (--offload optimizer)";
  if (dp_.sharded() && s_.optimizer != OptimizerKind::sgd) {
    formula += fmt::format(", of this rank's slices (ceil(n / {}) elements of each parameter)", s_.world);
  }
  return formula;
}

std::vector<Ref> OptimizerReplay::make_state(const CausalLM& shapes) {
  const int st = mem_.label("optimizer state", Category::optimizer, state_formula());
  const int working =
      mem_.label("optimizer working memory", Category::optimizer,
                 "scratch the optimizer keeps between steps (adafactor: float32, the largest parameter or the "
                 "rows its slice touches, and each matrix's row and column sums)");
  // The trainer's own optimizer class, built over the meta-device parameters: its state tensors
  // are what the trainer allocates, tensor by tensor, and nothing is allocated here.
  std::vector<Ref> state;
  {
    // Sharded: rank 0's slices of each parameter (the first ceil(n / N) elements), as the trainer's
    // DataParallel hands them to the optimizer.
    std::vector<NamedTensor> owned = shapes.trainable_parameters();  // frozen ones have no state
    // In the weights' dtype (bf16-params: float32 slices, where the model computes in bfloat16).
    for (auto& t : owned) t.tensor = t.tensor.to(parameter_dtype(s_.precision));
    OptimizerOptions options;
    if (dp_.sharded()) {
      options.sharding.emplace();
      for (auto& t : owned) {
        const int64_t n = t.tensor.numel();
        options.sharding->parameters.push_back({t.name, t.tensor.sizes().vec(), 0, std::min(dp_.chunk(n), n)});
        t.tensor = t.tensor.view(-1).narrow(0, 0, std::min(dp_.chunk(n), n));
      }
    }
    const std::unique_ptr<Optimizer> real = offloaded() ? make_offloaded_optimizer(s_.optimizer, owned, options)
                                                        : make_optimizer(s_.optimizer, owned, options);
    if (offloaded()) {
      // Each parameter's host copy and gradient buffer first, then its optimizer's state.
      const int copies = mem_.label("host parameter copies", Category::weights,
                                    "--offload optimizer: each trained parameter's copy in host memory");
      const int grads = mem_.label("host gradient copies", Category::gradients,
                                   "--offload optimizer: each trained parameter's gradient, copied to the host");
      const std::vector<at::Tensor> host = real->host_copies();
      for (size_t i = 0; i < host.size(); ++i) {
        state.push_back(mem_.allocate_host(static_cast<int64_t>(host[i].nbytes()), i % 2 == 0 ? copies : grads));
      }
    }
    int expert_st = -1;  // a mixture of experts' state, shown apart from the dense weights'
    for (const NamedTensor& t : real->state()) {
      int label = st;
      if (t.name.find(".mlp.experts.") != std::string::npos) {
        if (expert_st < 0) expert_st = mem_.label("expert optimizer state", Category::optimizer, state_formula() + " (the experts' parameters)");
        label = expert_st;
      }
      state.push_back(allocate(static_cast<int64_t>(t.tensor.nbytes()), label));
    }
    for (const at::Tensor& t : real->working_memory()) {
      state.push_back(allocate(static_cast<int64_t>(t.nbytes()), working));
    }
  }
  return state;
}

void OptimizerReplay::update_temporaries() {
  clipping_temporaries();
  if (s_.optimizer_impl == OptimizerImpl::torch) torch_update_temporaries();
  // Offloaded, the update runs on the host's cpu whatever the device.
  if (s_.optimizer == OptimizerKind::adafactor && ew_ != 4 && (!s_.cuda || offloaded())) adafactor_temporaries();
}

// Gradient clipping's norm: one partial per gradient, stacked, and the total (fp16: the scaler's
// found-inf flag too).
void OptimizerReplay::clipping_temporaries() {
  const int lbl = mem_.label("optimizer temporaries", Category::temporaries,
                             "gradient-norm partials for clipping, per-matrix factor statistics");
  std::vector<Ref> norms;
  int64_t gradients = 0;
  for (const auto& name : order_) {
    if (!params_.at(name).t.requires_grad()) continue;
    norms.push_back(mem_.allocate(4, lbl));
    ++gradients;
  }
  Ref stacked = mem_.allocate(gradients * 4, lbl);
  Ref total = mem_.allocate(4, lbl);
  if (s_.precision == Precision::fp16_mixed) Ref found_inf = mem_.allocate(4, lbl);
}

// torch.optim's update where it allocates and headroom's does not (the rest is in place in both):
// Adam and AdamW compute the denominator as exp_avg_sq.sqrt() / bias_correction, Adagrad as
// state_sum.sqrt(), each a new tensor. Single-tensor (torch's default on cpu): parameter by
// parameter, the square root and the quotient exist together, while the previous parameter's
// denominator is still bound to its Python name; foreach (the default on cuda): the square roots of
// every parameter's state at once (Adagrad: and the scaled gradients). Not modelled: the gradient
// copy that non-decoupled weight decay makes (Adam, Adagrad, SGD with weight_decay > 0; off by
// default), and torch's own Adafactor (headroom's is predicted). A mixture of experts' weights are,
// in transformers (the model such a script trains), two 3-D parameters a layer — every expert's
// gate and up projections in one, their down projections in another — so its single-tensor update
// makes each temporary that size, not one expert's.
void OptimizerReplay::torch_update_temporaries() {
  const bool adam = is_adam_family(s_.optimizer);
  if (!adam && s_.optimizer != OptimizerKind::adagrad) return;  // sgd, momentum: in place; adafactor: headroom's
  const int lbl = mem_.label(
      "torch.optim denominators", Category::temporaries,
      s_.cuda ? "foreach: sqrt of every parameter's state at once, parameters × " + std::to_string(ew_) + " B"
              : "single-tensor: sqrt(state) and its quotient for one parameter, and the "
                "previous parameter's denominator");
  auto bytes_of = [&](int64_t n) { return (dp_.sharded() ? std::min(dp_.chunk(n), n) : n) * ew_; };
  // The parameters as torch.optim sees them: transformers' tensors, in order.
  std::vector<int64_t> tensors;
  for (size_t i = 0; i < order_.size(); ++i) {
    const std::string& name = order_[i];
    if (!params_.at(name).t.requires_grad()) continue;  // frozen: no update
    const size_t at = name.find(".mlp.experts.");
    if (at == std::string::npos) {
      tensors.push_back(params_.at(name).t.numel);
      continue;
    }
    // The layer's experts, all of them from here: gate_up, then down.
    const std::string layer = name.substr(0, at);
    int64_t gate_up = 0, down = 0;
    for (; i < order_.size() && order_[i].rfind(layer + ".mlp.experts.", 0) == 0; ++i) {
      const bool is_down = order_[i].find("down_proj") != std::string::npos;
      (is_down ? down : gate_up) += params_.at(order_[i]).t.numel;
    }
    --i;
    tensors.push_back(gate_up);
    tensors.push_back(down);
  }
  if (s_.cuda && !offloaded()) {
    std::vector<Ref> roots, numerators;
    for (const int64_t n : tensors) roots.push_back(mem_.allocate(bytes_of(n), lbl));
    // Adagrad's foreach update also scales every gradient into a new tensor while the roots live.
    if (!adam) {
      for (const int64_t n : tensors) numerators.push_back(mem_.allocate(bytes_of(n), lbl));
    }
    return;
  }
  Ref denominator;
  for (const int64_t n : tensors) {
    Ref root = allocate(bytes_of(n), lbl);
    if (adam) {
      Ref quotient = allocate(bytes_of(n), lbl);
      root.reset();
      denominator = std::move(quotient);  // the previous one goes as the name is rebound
    } else {
      denominator = std::move(root);
    }
  }
}

// Adafactor works in its scratch and statistics buffers (working memory). 2-byte parameters on
// the CPU: the update's in-place ops mix the float32 scratch with the bf16 gradient and parameter,
// and the CPU kernels cast to float32 copies first — the parameter's update
// (param += update · -alpha) holds two of its part's size at once.
void OptimizerReplay::adafactor_temporaries() {
  const int lbl = mem_.label("optimizer temporaries", Category::temporaries);
  for (const auto& name : order_) {
    if (!params_.at(name).t.requires_grad()) continue;
    const int64_t n = params_.at(name).t.numel, part = dp_.sharded() ? std::min(dp_.chunk(n), n) : n;
    Ref upcast = allocate(part * 4, lbl), result = allocate(part * 4, lbl);
  }
}

}  // namespace headroom::replay
