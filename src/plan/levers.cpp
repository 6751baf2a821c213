#include "plan/levers.h"

#include <fmt/format.h>

#include "config/lever_support.h"
#include "device/device.h"

namespace headroom {

const char* lever_name(Lever lever) {
  switch (lever) {
    case Lever::accumulation: return "accumulation";
    case Lever::precision: return "precision";
    case Lever::checkpointing: return "checkpointing";
    case Lever::attention: return "attention";
    case Lever::optimizer: return "optimizer";
    case Lever::offload: return "offload";
    case Lever::base_weights: return "base weights";
    case Lever::loss: return "loss";
    case Lever::shard: return "shard";
  }
  return "?";
}

std::vector<Precision> precision_settings(Precision given) {
  if (given == Precision::bf16) return {Precision::bf16};
  return {Precision::fp32, Precision::bf16_mixed, Precision::fp16_mixed, Precision::bf16_params};
}

std::vector<CheckpointPolicy> checkpoint_settings(const ModelConfig& model) {
  std::vector<CheckpointPolicy> out = {CheckpointPolicy::none(), CheckpointPolicy::selective()};
  if (model.moe && model.moe->aux_loss) return out;
  for (int64_t k : {4, 2}) {
    if (model.num_layers > k) out.push_back(CheckpointPolicy::every_kth(k));
  }
  out.push_back(CheckpointPolicy::full());
  if (!model.moe) out.push_back(CheckpointPolicy::ops());  // config/lever_support.h
  return out;
}

std::vector<ShardLevel> shard_settings(int64_t world) {
  if (world <= 1) return {ShardLevel::none};
  return {ShardLevel::none, ShardLevel::optimizer, ShardLevel::gradients, ShardLevel::full};
}

std::vector<AttentionPath> attention_settings() { return {AttentionPath::flash, AttentionPath::math}; }

std::vector<OptimizerKind> optimizer_settings(OptimizerKind given, bool allow_change, bool allow_8bit) {
  std::vector<OptimizerKind> out = {given};
  if (allow_change) {
    for (OptimizerKind k : {OptimizerKind::adamw, OptimizerKind::adam, OptimizerKind::adafactor, OptimizerKind::momentum,
                            OptimizerKind::sgd, OptimizerKind::adagrad}) {
      if (k != given) out.push_back(k);
    }
  }
  if ((allow_change || allow_8bit) && is_adam_family(given) && given != OptimizerKind::adamw8bit) {
    out.push_back(OptimizerKind::adamw8bit);
  }
  return out;
}

std::vector<Offload> offload_settings(Offload given, bool allow, int64_t world) {
  if (!allow || world > 1) return {given};
  std::vector<Offload> out = {given};
  for (Offload o : kOffloads) {
    if (o != given) out.push_back(o);
  }
  return out;
}

std::vector<LossSetting> loss_settings(const LossSetting& given, ShardLevel shard, int64_t world) {
  if (given.chunked || (shard == ShardLevel::full && world > 1)) return {given};
  return {given, LossSetting{true, 0}};
}

bool trainable_where(OptimizerKind optimizer, Offload offload, bool cuda) {
  return !(cuda && optimizer == OptimizerKind::adamw8bit && !offloads_optimizer(offload));
}

namespace {

// A lever's change: its name, the setting, a note, and how it changes the configuration.
using AddChange = std::function<void(Lever, std::string, std::string, std::function<void(RunConfig&)>)>;

// The levers that change how the step computes: accumulation, precision, checkpointing, attention.
void add_step_changes(const RunConfig& cfg, const ModelConfig& model, const AddChange& add) {
  for (int64_t div : {2, 4}) {
    if (cfg.batch / div < 1 || cfg.batch % div != 0) continue;
    const int64_t micro = cfg.batch / div, accum = cfg.accum * div;
    add(Lever::accumulation, fmt::format("micro-batch {} x accum {}", micro, accum), "same global batch, same update",
        [micro, accum](RunConfig& c) {
          c.batch = micro;
          c.accum = accum;
        });
  }
  for (Precision p : {Precision::bf16_mixed, Precision::fp16_mixed, Precision::bf16, Precision::bf16_params}) {
    if (p == cfg.precision) continue;
    const char* note = p == Precision::bf16          ? "weights, gradients and state in bf16 too"
                       : p == Precision::bf16_params ? "FSDP2's: float32 weights and state, each layer cast to bf16 "
                                                       "when used, gradients reduced in float32"
                                                     : "autocast";
    add(Lever::precision, precision_name(p), note, [p](RunConfig& c) { c.precision = p; });
  }
  for (const CheckpointPolicy& k : checkpoint_settings(model)) {
    if (k == cfg.checkpointing || k.kind == CheckpointPolicy::Kind::none) continue;
    add(Lever::checkpointing, k.name(),
        k.per_op() ? "recompute in backward all but every second matmul and attention" : "recompute in backward",
        [k](RunConfig& c) { c.checkpointing = k; });
  }
  for (AttentionPath a : attention_settings()) {
    if (a == cfg.attention) continue;
    add(Lever::attention, attention_path_name(a),
        a == AttentionPath::math ? "the explicit path keeps the seq x seq scores" : "fused SDPA",
        [a](RunConfig& c) { c.attention = a; });
  }
}

// The levers that change what is kept and where: the optimizer, offload, the loss, the base weights.
void add_state_changes(const RunConfig& cfg, const AddChange& add) {
  for (OptimizerKind o : {OptimizerKind::adafactor, OptimizerKind::sgd, OptimizerKind::adam, OptimizerKind::adamw}) {
    if (o == cfg.optimizer) continue;
    std::string note = "changes the training dynamics";
    if (is_adam_family(o)) {
      if (!is_adam_family(cfg.optimizer)) continue;  // more state, not less
      note = fmt::format("the same state as {} (two moments per parameter): only the update differs",
                         optimizer_name(cfg.optimizer));
    }
    add(Lever::optimizer, optimizer_name(o), note, [o](RunConfig& c) { c.optimizer = o; });
  }
  // The same update with 8-bit moments (its loop runs on the cpu: on cuda only offloaded).
  const bool cuda = cfg.device.rfind("cuda", 0) == 0 || (cfg.device == "auto" && resolve_device(cfg.device).is_cuda());
  if (is_adam_family(cfg.optimizer) && cfg.optimizer != OptimizerKind::adamw8bit &&
      trainable_where(OptimizerKind::adamw8bit, cfg.offload, cuda)) {
    add(Lever::optimizer, optimizer_name(OptimizerKind::adamw8bit),
        "AdamW's update with blockwise 8-bit moments: about 2 B of state per parameter instead of 8",
        [](RunConfig& c) { c.optimizer = OptimizerKind::adamw8bit; });
  }
  if (cfg.offload == Offload::none && world_size_of(cfg) == 1 && cfg.optimizer != OptimizerKind::sgd) {
    add(Lever::offload, "optimizer",
        "the optimizer's state and update in host memory: each step copies the gradients down and the parameters up",
        [](RunConfig& c) { c.offload = Offload::optimizer; });
  }
  if (!offloads_activations(cfg.offload) && world_size_of(cfg) == 1) {
    const Offload with = offloads_optimizer(cfg.offload) ? Offload::both : Offload::activations;
    add(Lever::offload, offload_name(with),
        "what each layer saves for backward in host memory, copied back as backward needs it",
        [with](RunConfig& c) { c.offload = with; });
  }
  if (!cfg.loss.chunked && !(cfg.shard == ShardLevel::full && world_size_of(cfg) > 1)) {
    add(Lever::loss, "chunked",
        "the head and the loss a chunk of tokens at a time: never the whole tokens x vocab logits",
        [](RunConfig& c) { c.loss = LossSetting{true, 0}; });
  }
  if (cfg.finetune.is_lora() && cfg.base_weights == BaseWeights::dense) {
    add(Lever::base_weights, "nf4",
        "the frozen projections in 4-bit NF4 (QLoRA): about 0.56 B a value, dequantised a layer at a time",
        [](RunConfig& c) { c.base_weights = BaseWeights::nf4; });
  }
}

}  // namespace

std::vector<LeverChange> lever_changes(const RunConfig& cfg, const ModelConfig& model) {
  std::vector<LeverChange> out;
  // The flags of a change are what the field table writes for it on top of the configuration.
  auto add = [&](Lever lever, std::string setting, std::string note, std::function<void(RunConfig&)> apply) {
    RunConfig changed = cfg;
    apply(changed);
    // Train would refuse it.
    const int64_t data_ranks = world_size_of(changed) / (changed.pipeline.stages * changed.tensor_parallel);
    if (!levers_combine(changed, model, data_ranks)) return;
    out.push_back({lever, std::move(setting), shell_line(run_args(changed, cfg)), std::move(note), std::move(apply)});
  };
  add_step_changes(cfg, model, add);
  add_state_changes(cfg, add);
  return out;
}

}  // namespace headroom
