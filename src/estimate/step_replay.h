// StepReplay — one training step of the trainer replayed on the simulation, phase by phase as
// train()'s step loop runs it: the setup (the corpus in host memory, the model, data parallel's
// buffers, the optimizer's state, cuBLAS's workspace), then each micro-batch (data, forward with its
// loss, backward), the optimizer phase (the update and its temporaries) and zero_grad. The model is
// estimate/layer_replay.h, data parallel estimate/data_parallel_replay.h, the optimizer
// estimate/optimizer_replay.h; what it returns is the Estimate of estimate/estimator.h, with the peak
// of the whole timeline and, with a caching allocator, the reserved memory its allocations lead to.
//
// One replay per estimate: run() once.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "config/model_config.h"
#include "estimate/data_parallel_replay.h"
#include "estimate/estimator.h"
#include "estimate/layer_replay.h"
#include "estimate/optimizer_replay.h"
#include "estimate/sim.h"

namespace headroom::replay {

// A caching allocator's replay of a step's allocations (estimate/reserved.h) runs the step this
// many times: the cache reaches its steady state in the second (the first's free blocks are what
// the second finds).
inline constexpr int kReservedSteps = 2;

class StepReplay : LayerReplay {
 public:
  StepReplay(const ModelConfig& c, const TrainSpec& s);

  Estimate run();
  // After run(): its allocation sequence (what a caching allocator would see, estimate/reserved.h)
  // and where the step begins in it; taken once.
  size_t step_begin() const { return step_begin_; }
  std::vector<sim::Memory::Event> take_events() {
    std::vector<sim::Memory::Event> events = mem_.take_events();
    events.resize(step_end_);
    return events;
  }

 private:
  using CategoryBytes = std::array<int64_t, sim::kCategories>;

  void setup();
  void load_corpus();
  void reserve_cublas_workspace();
  void micro_batch(int64_t rows);
  // --pipeline: this stage's one_f_one_b() schedule over the step's micro-batches
  // (train/pipeline_step.h), in place of micro_batch().
  void pipeline_schedule();
  // The forward and the loss of `rows` sequences, under one autocast scope.
  sim::Tensor forward_phase(int64_t rows, int batch_lbl, int loss_lbl, const sim::Tensor* input = nullptr);
  void backward_phase(sim::Tensor loss);
  // Returns live bytes by category as the update finds them.
  CategoryBytes optimizer_phase();
  void zero_grad_phase();
  // The estimate from the replay: the peak and what it held; `step_begin`: the step's first event.
  Estimate result(const CategoryBytes& at_update, size_t step_begin) const;

  DataParallelReplay dp_;
  OptimizerReplay optimizer_;
  sim::Ref dataset_, dataset_eval_;
  sim::Ref workspace_;  // cuda: cuBLAS's
  size_t step_begin_ = 0, step_end_ = 0;
};

}  // namespace headroom::replay
