// DataParallelReplay — data parallel (lever 6) on the simulation, as dist/data_parallel.cpp runs it
// on rank 0 (the rank with the largest slices), step for step: the collectives' buffers (unsharded:
// the gradients allreduced in 25 MiB buckets before the update; sharded: each gradient
// reduce-scattered into this rank's shard, during backward at the gradients and full levels, before
// the update at the optimizer level; the parameters all-gathered after the update), and under full
// sharding the weights themselves: this rank's slices, and a unit's parameters all-gathered while the
// forward or backward uses them (the layers' ShardGate, estimate/layer_replay.h).
//
// The step (estimate/step_replay.h) calls it at each point where DataParallel acts; with one rank
// every call but the gate's is a no-op, and the gate is not installed unless fully sharded.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "estimate/estimator.h"
#include "estimate/layer_replay.h"
#include "estimate/ops.h"
#include "model/causal_lm.h"

namespace headroom::replay {

class DataParallelReplay final : public ShardGate {
 public:
  // The model's parameters, by name and in registration order (filled before prepare()). `ew`: bytes
  // of a weight slice, and of the gradients' shard; `compute_ew`: of a gathered parameter and its
  // gradient (bf16-params: 2, cast from the float32 slices; else ew).
  DataParallelReplay(sim::Memory& memory, const TrainSpec& s, const std::map<std::string, sim::Param>& params,
                     const std::vector<std::string>& order, int ew, int compute_ew);

  // bf16-params on one process: FSDP2's policy through a group of one (dist/communicator.h), the
  // collectives copies.
  bool alone() const { return s_.world == 1 && s_.precision == Precision::bf16_params; }
  // This rank holds slices of the optimizer state (optimizer, gradients and full levels).
  bool sharded() const { return (s_.world > 1 && s_.shard != ShardLevel::none) || alone(); }
  // full: the weights sharded too.
  bool fully_sharded() const { return (s_.world > 1 && s_.shard == ShardLevel::full) || alone(); }
  // Elements of a parameter of `numel` per rank: ceil(numel / world).
  int64_t chunk(int64_t numel) const { return (numel + s_.world - 1) / s_.world; }

  // After the model is built: the labels, the gradient shard, the gradients' hooks and, under full
  // sharding, the weight slices and the units.
  void prepare(const CausalLM& shapes);
  // At the start of a micro-batch: no gradient has arrived or been reduced yet.
  void start_micro_batch();
  // ShardGate.
  void gather(int unit) override;
  void forward_done(int unit, bool recording) override;
  void keep_slice(const std::string& name) override;
  // After backward: the reductions still outstanding, the layers let go, and the ranks' agreement.
  void after_backward();
  // At the start of the update: the loss summed over the ranks, and the reductions that wait for it.
  void before_update();
  // After the update (optimizer and gradients levels): every parameter all-gathered from the slices.
  void after_update();
  // zero_grad: full drops its slices' gradients (the other levels zero their shard in place).
  void zero_grad();

 private:
  // gradients, full: each gradient reduce-scattered during backward.
  bool reduces_in_backward() const { return fully_sharded() || (s_.world > 1 && s_.shard == ShardLevel::gradients); }
  // Gloo's own buffers (several cpu ranks): a flat result an all-gather copies out of, a flat copy
  // of what a reduce-scatter reduces.
  bool gloo_buffers() const { return !s_.cuda && s_.world > 1; }
  void prepare_full_sharding(const CausalLM& shapes);
  void release(int unit);
  void reduce_scatter(size_t i, bool zeros);
  void gradient_ready(size_t i);
  void finish_backward();
  void allreduce_buckets();
  void gather_parameters();
  // The transients of one all-gather of a parameter of n elements in chunks of c, `elem` bytes each
  // (DataParallel::allgather_into): the result padded to N chunks unless that is the parameter.
  void allgather(int64_t n, int64_t c, int elem);
  void agreement() { sim::Ref flag = mem_.allocate(8, comm_); }  // a one-element int64 allreduce

  sim::Memory& mem_;
  const TrainSpec& s_;
  const std::map<std::string, sim::Param>& params_;
  const std::vector<std::string>& order_;
  int ew_;                   // weight slice and gradient shard bytes
  int compute_ew_;           // gathered parameter and gradient bytes
  int comm_ = -1;            // label of the collectives' buffers
  int shard_lbl_ = -1;
  sim::Ref shard_;           // optimizer, gradients: this rank's reduced gradients, one chunk per parameter
  std::vector<sim::Ref> slice_grads_;  // full: per parameter (order_), its slice's gradient once reduced
  std::vector<bool> ready_;  // gradients: accumulated this backward, not yet reduced
  size_t next_ = 0;          // gradients: reductions issued this backward (last parameter first)
  // full
  std::vector<sim::Ref> slices_;  // per parameter (order_): rank 0's weight slice
  std::map<std::string, sim::Ref> kept_;  // the slices kept while the model was built, by name
  int slice_label();
  std::vector<int> units_;        // per parameter (order_): its unit
  std::vector<std::vector<size_t>> unit_params_;
  std::vector<std::vector<sim::Ref>> gathered_;  // per unit: its parameters in full, while gathered
  std::vector<size_t> arrived_;                  // per unit: gradients accumulated this backward
  int gathered_lbl_ = -1;
};

}  // namespace headroom::replay
