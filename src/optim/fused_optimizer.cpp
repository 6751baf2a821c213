#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "optim/optimizers.h"

namespace headroom {

FusedOptimizer::FusedOptimizer(const std::vector<NamedTensor>& params, std::vector<std::string> slots,
                               int step_slot,
                               const std::function<std::vector<at::Tensor>(const at::Tensor&)>& make_state,
                               const OptimizerOptions& options)
    : slot_names_(std::move(slots)), step_slot_(step_slot), weight_decay_(options.weight_decay) {
  c10::NoGradGuard no_grad;
  for (const auto& p : params) {
    Entry e{p.name, p.tensor, make_state(p.tensor)};
    TORCH_CHECK(e.state.size() == slot_names_.size(), "FusedOptimizer: make_state returned the wrong slot count");
    (decays(p, options) ? decay_ : no_decay_).push_back(std::move(e));
  }
}

void FusedOptimizer::step(double lr) {
  c10::NoGradGuard no_grad;
  for (auto* group : {&decay_, &no_decay_}) {
    Batch batch;
    batch.slots.resize(slot_names_.size());
    for (Entry& e : *group) {
      if (!e.param.grad().defined()) continue;
      if (step_slot_ >= 0) {
        at::Tensor& counter = e.state[static_cast<size_t>(step_slot_)];
        if (e.steps < 0) e.steps = static_cast<int64_t>(counter.item<double>());
        counter.fill_(static_cast<double>(++e.steps));
      }
      batch.params.push_back(e.param);
      batch.grads.push_back(e.param.grad());
      for (size_t k = 0; k < slot_names_.size(); ++k) batch.slots[k].push_back(e.state[k]);
    }
    if (!batch.params.empty()) update(batch, lr, group == &decay_ ? weight_decay_ : 0.0);
  }
}

std::vector<NamedTensor> FusedOptimizer::state() const {
  std::vector<NamedTensor> out;
  for (const auto* group : {&decay_, &no_decay_}) {
    for (const Entry& e : *group) {
      for (size_t k = 0; k < slot_names_.size(); ++k) out.push_back({e.name + "." + slot_names_[k], e.state[k]});
    }
  }
  return out;
}

}  // namespace headroom
