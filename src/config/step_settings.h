// StepSettings — the levers one training step runs with, declared once.
//
// The micro-batch and its accumulation (lever 3), the sequence length, precision (4), activation
// checkpointing (5), the attention path, the loss (full or chunked), the optimizer (8) and whose update of it an estimate
// predicts, the data-parallel shard level and the pipeline's stages (6), what is offloaded to host memory, the routing an estimate assumes for a mixture of
// experts, and which parameters train (frozen ones, LoRA adapters). What a run is told (RunConfig,
// config/run_config.h), what the estimator predicts (TrainSpec, estimate/estimator.h) and what the
// planner proposes (Plan, plan/planner.h) are each a StepSettings plus fields of their own, so a
// setting of the step is written here once and passes between them whole (`a.step() = b.step()`),
// never field by field. The field table in config/run_config.cpp reads and writes it.
#pragma once

#include <cstdint>

#include "config/attention_path.h"
#include "config/base_weights.h"
#include "config/checkpoint_policy.h"
#include "config/finetune.h"
#include "config/loss.h"
#include "config/moe_routing.h"
#include "config/offload.h"
#include "config/optimizer_kind.h"
#include "config/pipeline_layout.h"
#include "config/precision.h"
#include "config/shard_level.h"

namespace headroom {

struct StepSettings {
  int64_t batch = 8;  // micro-batch, sequences (per rank with several ranks)
  int64_t accum = 1;  // micro-batches per optimizer step
  int64_t seq = 128;  // tokens per sequence
  Precision precision = Precision::fp32;
  OptimizerKind optimizer = OptimizerKind::adamw;
  OptimizerImpl optimizer_impl = OptimizerImpl::headroom;  // estimate, plan: whose update to predict
  CheckpointPolicy checkpointing;
  AttentionPath attention = AttentionPath::flash;
  ShardLevel shard = ShardLevel::none;
  bool reshard_after_forward = true;  // full sharding: a layer's gathered weights go after its forward
  MoeRouting routing;  // estimate, plan: the routing a mixture of experts is assumed to have
  Finetune finetune;   // which parameters train: all, all but frozen ones, or LoRA adapters
  BaseWeights base_weights = BaseWeights::dense;  // LoRA's frozen projections: dense, or NF4
  Offload offload = Offload::none;  // what lives in host memory (the optimizer's state and update)
  LossSetting loss;                 // the head and the loss over all tokens at once, or in chunks
  PipelineLayout pipeline;          // layers across ranks in stages (1: none)
  int64_t tensor_parallel = 1;      // each layer's matrices and the vocabulary split over ranks (1: none)
  bool sequence_parallel = true;    // with tensor parallel: the tokens between the blocks split over its ranks

  // This object as the step's settings alone, to assign or compare them whole.
  StepSettings& step() { return *this; }
  const StepSettings& step() const { return *this; }
  bool operator==(const StepSettings&) const = default;
};

}  // namespace headroom
