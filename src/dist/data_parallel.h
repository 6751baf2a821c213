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
//   full       (ZeRO-3) not built yet: refused by make_run.
//
// The ranks agree after every micro-batch (agree()): a rank that ran out of memory completes the
// micro-batch's remaining collectives with zeros (abandon_backward) so that no one waits forever,
// and all of them then act on the worst outcome together (train/oom_guard.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "config/shard_level.h"
#include "dist/communicator.h"
#include "util/named_tensor.h"

namespace headroom {

class DataParallel {
 public:
  DataParallel(Communicator& comm, const std::vector<NamedTensor>& params, ShardLevel level,
               int64_t bucket_bytes = int64_t{25} << 20);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  ShardLevel level() const { return level_; }
  Communicator& comm() { return comm_; }
  bool sharded() const { return level_ != ShardLevel::none; }

  // What the optimizer updates: the parameters themselves (none), else this rank's non-empty slices,
  // 1-D views into the parameters named as them, whose .grad is their part of the shard buffer.
  const std::vector<NamedTensor>& optimizer_parameters() const { return optimizer_params_; }
  // Whether the optimizer's tensor of this name belongs to a matrix (weight decay applies).
  bool is_matrix(const std::string& name) const;
  // This rank's slice of the named parameter's flattened elements: {start, length} ({0, numel}
  // unsharded); nullopt for a name that is not a parameter.
  std::optional<std::pair<int64_t, int64_t>> slice_of(const std::string& name) const;

  // At the start of each micro-batch, and after its backward (gradients: the hooks' bookkeeping, and
  // the reductions the hooks left).
  void begin_micro_batch();
  void end_backward();
  // After a failed micro-batch, on the rank that failed: the collectives its backward still owed,
  // with zero contributions; then every gradient (the shard's too) is dropped.
  void abandon_backward();
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
  // Memory this class holds across steps (the shard gradient buffer), for the monitor's gradients.
  std::vector<at::Tensor> gradient_buffers() const;

 private:
  struct Slice {
    int64_t numel = 0, chunk = 0;  // the parameter's elements; c = ceil(numel / N)
    int64_t start = 0, length = 0;  // this rank's slice of the flattened parameter
    int64_t buffer_offset = 0;     // its chunk in the shard gradient buffer
    bool matrix = false;
  };
  void reduce_parameter(size_t i, bool zeros);
  void allreduce_buckets();

  Communicator& comm_;
  std::vector<NamedTensor> params_;
  ShardLevel level_;
  int64_t bucket_bytes_;
  std::vector<Slice> slices_;
  std::vector<NamedTensor> optimizer_params_;
  at::Tensor shard_grads_;     // sharded: Σ chunk elements, this rank's reduced gradients
  std::vector<bool> ready_;    // gradients: accumulated this backward, not yet reduced
  size_t next_ = 0;            // gradients: reductions issued this backward (in the fixed order)
  bool in_backward_ = false;
};

}  // namespace headroom
