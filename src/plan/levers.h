// Levers — the one table of what headroom can change about a run to make it fit: gradient
// accumulation (lever 3), precision (4), activation checkpointing (5), the attention path, the
// optimizer (8) with its 8-bit states and host offload and, with several data-parallel ranks, the shard level (6). The planner enumerates its candidates from it, the doctor tries each change it
// lists, and the OOM advice names them; a new setting joins here and nowhere else.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "config/run_config.h"

namespace headroom {

enum class Lever { accumulation, precision, checkpointing, attention, optimizer, offload, base_weights, loss, shard };
const char* lever_name(Lever lever);

// The settings of each lever, as the planner enumerates them.
// Precisions: fp32, bf16-mixed and fp16-mixed; a run given pure bf16 stays in pure bf16 (its
// weights are bf16: the others would be a different model).
std::vector<Precision> precision_settings(Precision given);
// none, selective, every:4 and every:2 where the model is deeper than that, full. Not the
// whole-layer ones for a mixture of experts that trains with its load-balancing loss (the trainer
// refuses them: model/causal_lm.h).
std::vector<CheckpointPolicy> checkpoint_settings(const ModelConfig& model);
std::vector<AttentionPath> attention_settings();
// Shard levels for `world` data-parallel ranks: none alone for one rank; else none, optimizer,
// gradients and full.
std::vector<ShardLevel> shard_settings(int64_t world);
// The optimizers from the given one: only it, or (allow_change) every kind, the given one first;
// with allow_8bit, adamw8bit too where the given one is Adam or AdamW (the same update).
std::vector<OptimizerKind> optimizer_settings(OptimizerKind given, bool allow_change, bool allow_8bit = false);
// What may be offloaded: the given setting, or (allow) every setting with one rank.
std::vector<Offload> offload_settings(Offload given, bool allow, int64_t world);
// The loss: the given one, and chunked where it is full (the same numbers; not with --shard full on
// ranks, which the trainer refuses).
std::vector<LossSetting> loss_settings(const LossSetting& given, ShardLevel shard, int64_t world);
// Whether a run of these settings can train at all where `cuda` says: adamw8bit's update runs on
// the cpu, so on cuda only offloaded.
bool trainable_where(OptimizerKind optimizer, Offload offload, bool cuda);

// One change of one lever from a run's configuration.
struct LeverChange {
  Lever lever;
  std::string setting;  // "bf16-mixed", "micro-batch 8 x accum 2"
  std::string flags;    // the command-line flags that make it: "--precision bf16-mixed" (run_args)
  std::string note;     // what it changes besides memory
  std::function<void(RunConfig&)> apply;
};

// Each single-lever change worth trying from `config` (of `model`), in lever order:
// accumulation at a half and a quarter of the micro-batch (same global batch), every other
// precision, every other checkpointing policy, the other attention path, and the optimizers with
// less state (adafactor, sgd) — or, for adam and adamw, the other one, which holds the same state —
// their 8-bit states, the optimizer offloaded to host memory (one process), and for LoRA the frozen
// base in NF4.
std::vector<LeverChange> lever_changes(const RunConfig& config, const ModelConfig& model);

}  // namespace headroom
