// OptimizerReplay — the optimizer on the simulation: its state, tensor by tensor as the trainer's
// own optimizer class (optim/optimizer.h) allocates it when it is constructed (sharded: over this
// rank's slices, as DataParallel hands them to it), its working memory, and what the update
// allocates on top: the gradient-norm partials of clipping, torch.optim's denominators when its
// update is the one run, and Adafactor's float32 copies of 2-byte parameters on the CPU. Offloaded
// (--offload optimizer), the state, the update's temporaries and the host copies of the parameters
// and gradients are host memory (sim::Memory::allocate_host), as optim/offload.h keeps them.
//
// The step (estimate/step_replay.h) makes the state before the first micro-batch and keeps it for
// the step; update_temporaries() is the optimizer phase's own allocations, all released by its end.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "estimate/data_parallel_replay.h"
#include "estimate/estimator.h"
#include "estimate/ops.h"
#include "model/causal_lm.h"

namespace headroom::replay {

class OptimizerReplay {
 public:
  // The model's parameters, by name and in registration order (filled before make_state()).
  OptimizerReplay(sim::Memory& memory, const TrainSpec& s, const std::map<std::string, sim::Param>& params,
                  const std::vector<std::string>& order, const DataParallelReplay& dp, int ew);

  // The optimizer's state and working memory, made when it is constructed (before the first step):
  // live while the returned buffers are.
  [[nodiscard]] std::vector<sim::Ref> make_state(const CausalLM& shapes);
  // The update's temporaries, each released before it returns.
  void update_temporaries();

 private:
  bool offloaded() const { return offloads_optimizer(s_.offload); }
  // The optimizer's own memory: on the device, or in host memory when offloaded.
  sim::Ref allocate(int64_t bytes, int label) {
    return offloaded() ? mem_.allocate_host(bytes, label) : mem_.allocate(bytes, label);
  }
  // The optimizer state's formula, for the table.
  std::string state_formula() const;
  void clipping_temporaries();
  void torch_update_temporaries();
  void adafactor_temporaries();

  sim::Memory& mem_;
  const TrainSpec& s_;
  const std::map<std::string, sim::Param>& params_;
  const std::vector<std::string>& order_;
  const DataParallelReplay& dp_;
  int ew_;  // parameter bytes
};

}  // namespace headroom::replay
