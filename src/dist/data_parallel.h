// DataParallel — what a training step does differently when N ranks train one model together
// (lever 6), at each shard level (config/shard_level.h), over a Communicator.
//
// Each rank runs the same step on its own rows of the global batch (train/step.h); the micro-batch
// losses are weighted by the global batch's rows, so the gradients' sum over ranks is the gradient
// one process would compute on the whole global batch.
//
//   none       after the last micro-batch's backward, every gradient is summed over the ranks, in
//              flat buckets of at most `bucket_bytes` (one allreduce each); each rank then runs the
//              whole optimizer itself, on identical gradients, to identical weights.
//   optimizer  (ZeRO-1) parameter p of n elements is cut in N slices of c = ceil(n/N) elements (the
//              last ones shorter, possibly empty); rank r owns slice r of each. After the last
//              backward each gradient is reduce-scattered (padded to N·c) into the rank's shard
//              gradient buffer and released; the optimizer holds state for, and updates, only the
//              owned slices (1-D views into the parameters); then every parameter is all-gathered
//              from its slices.
//   gradients  (ZeRO-2) as optimizer, but each gradient is reduce-scattered during backward, as
//              soon as autograd has accumulated it (device/grad_hook_adapter.h), and released, so a
//              rank never holds more than its shard and the gradients of the parameters in flight.
//              To keep every rank's collectives in the same order whatever order autograd finishes
//              parameters in, reductions are issued in a fixed order (last parameter first), a
//              finished parameter waiting for those before it; end_backward() issues the rest.
//   full       (ZeRO-3) as gradients, and the weights are sharded too: rank r keeps only slice r of
//              each parameter, in memory of its own, which the optimizer updates; the parameters
//              themselves hold no memory (device/storage_adapter.h) except while the model uses them.
//              The model asks for each unit (model/parameter_gate.h: the embeddings and head, or one
//              layer) before its forward, and each layer again before its backward; a unit is
//              all-gathered from the ranks' slices then, and let go after its forward (the
//              embeddings and head stay, backward starts with the head) and once backward has
//              accumulated all its gradients. A rank's weights are its slices and at most the
//              embeddings, the head and one layer in full. Its gradient slices are made by their first
//              reduction of a step and dropped by zero_grad (FSDP2's sharded gradients), where the
//              other levels keep one shard buffer across steps.
//
// The ranks agree after every micro-batch (agree()): a rank that ran out of memory completes the
// micro-batch's remaining collectives with zeros (abandon_backward) so that no one waits forever,
// and all of them then act on the worst outcome together (train/oom_guard.h). At full the gathers
// interleave with the reductions in an order autograd decides — the same on every rank and in every
// micro-batch, but known only once one has run: each micro-batch's collectives are recorded, and a
// rank that failed part-way issues the rest of the last complete one's. The trainer runs a one-row
// rehearsal micro-batch first (train/step.h), so that even the first real one can be recovered.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/shard_level.h"
#include "dist/communicator.h"
#include "memory/allocation_tag.h"
#include "model/parameter_gate.h"
#include "optim/optimizer.h"
#include "util/named_tensor.h"

namespace headroom {

// How a fully sharded run (level full) holds and gathers its units, as FSDP2's fully_shard options.
struct FullSharding {
  // --precision bf16-params (MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)): the
  // slices stay in the parameters' dtype (float32, as the optimizer updates them), the parameters
  // themselves become this dtype, each slice cast to it before the all-gather; their gradients come
  // in it and are cast back to the slices' dtype to be reduce-scattered. nullopt: no cast.
  std::optional<c10::ScalarType> compute;
  // reshard_after_forward: a layer lets its gathered parameters go after its forward, to gather them
  // again for its backward (true), or keeps them until backward has its gradients (false).
  bool reshard_after_forward = true;
};

class DataParallel final : private ParameterGate {
 public:
  // At full only: `units`, the unit of each parameter (CausalLM::parameter_units()); `slices`, this
  // rank's slice of each parameter kept while the model was built (weight_slice(), through
  // CausalLM's KeepParameter), or empty to cut them from the parameters here; `full`, how units
  // are held and gathered.
  DataParallel(Communicator& comm, const std::vector<NamedTensor>& params, ShardLevel level,
               std::vector<int> units = {}, std::vector<at::Tensor> slices = {}, FullSharding full = {},
               int64_t bucket_bytes = int64_t{25} << 20);
  // Rank `rank` of `ranks`'s slice of a parameter's flattened elements, in memory of its own: elements
  // [r·c, min((r+1)·c, n)) with c = ceil(n / ranks).
  static at::Tensor weight_slice(const at::Tensor& param, int rank, int ranks);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  ShardLevel level() const { return level_; }
  Communicator& comm() { return comm_; }
  bool sharded() const { return level_ != ShardLevel::none; }
  // Gradients reduce-scattered during backward (gradients, full).
  bool reduces_in_backward() const { return level_ == ShardLevel::gradients || level_ == ShardLevel::full; }

  // full: what the model's forward asks for its parameters (null at the other levels).
  ParameterGate* gate() { return level_ == ShardLevel::full ? this : nullptr; }

  // What the optimizer updates: the parameters themselves (none), else this rank's non-empty slices,
  // named as their parameters: 1-D views into the parameters whose .grad is their part of the shard
  // buffer (optimizer, gradients), or the rank's own weight slices, with a .grad once reduced (full).
  const std::vector<NamedTensor>& optimizer_parameters() const { return optimizer_params_; }
  // What the optimizer must know of the parameters when it updates slices (their shapes, and a sum
  // over the ranks for adafactor's per-matrix statistics); nullopt unsharded.
  std::optional<OptimizerSharding> optimizer_sharding();
  // This rank's slice of the named parameter's flattened elements: {start, length} ({0, numel}
  // unsharded); nullopt for a name that is not a parameter.
  std::optional<std::pair<int64_t, int64_t>> slice_of(const std::string& name) const;

  // At the start of each micro-batch, and after its backward (gradients: the hooks' bookkeeping, and
  // the reductions the hooks left).
  void begin_micro_batch();
  void end_backward();
  // After a failed micro-batch, on the rank that failed: the collectives its backward still owed,
  // with zero contributions; then every gradient (the shard's too) is dropped. Throws Error at full
  // when no micro-batch has completed yet (the others' collectives are not known).
  void abandon_backward();
  // A forward without backward (evaluation) starts; after one that failed on this rank, the gathers
  // (full) it still owed, with zeros — a forward's are every unit's parameters in unit order.
  void begin_forward();
  void abandon_forward();
  // full: whether a micro-batch has completed, so that a failed one can be replayed to the others
  // (alone, there are none to replay it to).
  bool knows_collective_order() const { return level_ != ShardLevel::full || !pattern_.empty() || comm_.size() == 1; }
  // Every rank passes its outcome code; all get the largest (0: all well).
  int agree(int code);
  double sum(double value);

  // After the last micro-batch (none: the bucketed allreduce; optimizer: the reduce-scatter).
  void reduce_gradients();
  // The gradients the optimizer will use (for fp16's unscale).
  std::vector<at::Tensor> gradients() const;
  // Whether any rank saw a non-finite gradient.
  bool any(bool flag);
  // Clips the global gradient norm to max_norm (<= 0: no clipping); returns the norm before.
  double clip_grad_norm(double max_norm);
  // After the optimizer (sharded): every parameter gathered from the ranks' updated slices.
  void gather_parameters();
  // The next step starts from no gradient (full gradients dropped, the shard buffer zeroed).
  void zero_grad();
  // The reduced gradients this class holds (the shard gradient buffer; at full the slices' own), for
  // the monitor's gradients.
  std::vector<at::Tensor> gradient_buffers() const;
  // Told what this class's allocations are from then on (memory/allocation_tag.h): a collective's
  // buffers, weights gathered from the ranks' slices, none once done; for the monitor's categories.
  void tag_allocations_with(std::function<void(AllocationTag)> tag) { tag_ = std::move(tag); }
  // full: the rank's weight slices, for the monitor's weights (empty at the other levels).
  const std::vector<at::Tensor>& weight_slices() const { return weight_slices_; }
  // What a checkpoint holds of the weights: the parameters, or at full this rank's slice of each,
  // 1-D and named as its parameter.
  std::vector<NamedTensor> checkpoint_weights() const;

 private:
  struct Slice {
    int64_t numel = 0, chunk = 0;  // the parameter's elements; c = ceil(numel / N)
    int64_t start = 0, length = 0;  // this rank's slice of the flattened parameter
    int64_t buffer_offset = 0;      // its chunk in the shard gradient buffer
  };
  void reduce_parameter(size_t i, bool zeros);
  // Parameter i's reduced chunk (`reduced`, of its chunk's elements or, alone, its own) into this
  // rank's gradient of its slice: the shard buffer's part (optimizer, gradients), or the slice's own
  // .grad at full — the first reduction's buffer itself when it can be, later ones added.
  void accumulate_shard(size_t i, const at::Tensor& reduced);
  // The ranks' chunks (this one's: `chunk`, s.chunk elements) into the flattened parameter `flat`.
  void allgather_into(at::Tensor& flat, at::Tensor& chunk, const Slice& s);
  void reduce_remaining();  // gradients, full: the reductions this backward has not issued, with zeros
  void allreduce_buckets();
  void gather(int unit) override;
  void forward_done(int unit) override;
  void release(int unit);
  void release_all();
  void gather_zeros(size_t param);  // a gather of the parameter with nothing of this rank's in it
  // Runs `owed` (collectives the others are waiting in); an OOM in it becomes an Error: the ranks
  // cannot be kept in step after it.
  void completing_owed_collectives(const std::function<void()>& owed);

  class Tagged;  // while alive, allocations have its tag (nests)

  Communicator& comm_;
  std::function<void(AllocationTag)> tag_;
  AllocationTag current_tag_ = AllocationTag::none;
  std::vector<NamedTensor> params_;
  ShardLevel level_;
  FullSharding full_;
  int64_t bucket_bytes_;
  std::vector<Slice> slices_;
  std::vector<NamedTensor> optimizer_params_;
  at::TensorOptions grad_options_;  // the reduced gradients' (the slices' dtype)
  at::Tensor shard_grads_;  // optimizer, gradients: Σ chunk elements, this rank's reduced gradients
  std::vector<bool> ready_;    // gradients: accumulated this backward, not yet reduced
  size_t next_ = 0;            // gradients: reductions issued this backward (in the fixed order)
  bool in_backward_ = false;
  // full
  std::vector<at::Tensor> weight_slices_;         // per parameter: this rank's slice, its own memory
  std::vector<int> units_;                        // per parameter: its unit
  std::vector<std::vector<size_t>> unit_params_;  // per unit: its parameters
  std::vector<bool> gathered_;                    // per unit: its parameters hold their values
  std::vector<size_t> arrived_;                   // per unit: gradients accumulated this backward
  struct Collective {
    bool gather = false;  // an all-gather of the parameter's weights, else a reduce-scatter of its gradient
    size_t param = 0;
    bool operator==(const Collective&) const = default;
  };
  std::vector<Collective> issued_;   // this micro-batch's, in order
  std::vector<Collective> pattern_;  // the last complete micro-batch's
};

}  // namespace headroom
