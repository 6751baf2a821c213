#include "config/lever_support.h"

#include "util/error.h"

namespace headroom {

namespace {

// --checkpointing ops counts a layer's matmuls as the dense projections make them
// (model/op_checkpoint.h): adapters, 4-bit bases and experts add matmuls of their own.
void check_per_op_checkpointing(const StepSettings& s, const ModelConfig& model) {
  const char* others = "accepted: --checkpointing full, every:K, selective or none";
  if (s.finetune.is_lora()) {
    fail("--checkpointing ops with --finetune {}: not supported yet (the adapters' matmuls are not counted); {}",
         s.finetune.name(), others);
  }
  if (model.moe) {
    fail(
        "--checkpointing ops with {} (a mixture of experts): not supported yet (the experts' matmuls are not "
        "counted); {}",
        model.name, others);
  }
  if (offloads_activations(s.offload)) {
    fail("--checkpointing ops with --offload {}: not supported yet; {}, or --offload optimizer",
         offload_name(s.offload), others);
  }
  if (s.tensor_parallel > 1) {
    fail("--checkpointing ops with --tensor-parallel {}: not supported yet; {}", s.tensor_parallel, others);
  }
}

// --precision bf16-params is FSDP2's policy, which the fully sharded step runs (dist/data_parallel.h).
void check_fsdp_precision(const StepSettings& s, int64_t data_ranks) {
  if (data_ranks > 1 && s.shard != ShardLevel::full) {
    fail(
        "--precision bf16-params with --shard {} on {} data-parallel ranks: not supported yet; accepted: --shard "
        "full (FSDP2), or --precision bf16-mixed",
        shard_level_name(s.shard), data_ranks);
  }
  if (!s.finetune.full()) {
    fail(
        "--precision bf16-params with --finetune {}: not supported yet; accepted: --finetune full, or --precision "
        "bf16 or bf16-mixed",
        s.finetune.name());
  }
  if (s.offload != Offload::none) {
    fail("--precision bf16-params with --offload {}: not supported yet; accepted: --offload none",
         offload_name(s.offload));
  }
  if (s.loss.chunked) {
    fail(
        "--precision bf16-params with --loss {}: not supported yet (the head is released after the forward that "
        "gathers it, as at --shard full); accepted: --loss full",
        s.loss.name());
  }
}

}  // namespace

void check_lever_support(const StepSettings& s, const ModelConfig& model, int64_t data_ranks) {
  if (s.checkpointing.per_op()) check_per_op_checkpointing(s, model);
  if (s.precision == Precision::bf16_params) check_fsdp_precision(s, data_ranks);
  if (!s.reshard_after_forward && s.precision != Precision::bf16_params &&
      (s.shard != ShardLevel::full || data_ranks < 2)) {
    fail(
        "--reshard-after-forward=false keeps gathered layers between forward and backward, which only --shard full "
        "on several ranks or --precision bf16-params gather; accepted: --reshard-after-forward true here");
  }
  if (s.tensor_parallel > 1 && s.sequence_parallel && s.seq % s.tensor_parallel != 0) {
    fail(
        "--seq {} with --tensor-parallel {} and sequence parallel: each rank holds seq/T of every sequence's "
        "tokens; accepted: a --seq that is a multiple of {}, or --sequence-parallel=false",
        s.seq, s.tensor_parallel, s.tensor_parallel);
  }
}

bool levers_combine(const StepSettings& s, const ModelConfig& model, int64_t data_ranks) {
  try {
    check_lever_support(s, model, data_ranks);
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace headroom
