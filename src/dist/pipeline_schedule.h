// The pipeline's layout and schedule, apart from its communication (dist/pipeline.h), so that the
// estimator replays what each stage does without a rank: which layers each stage holds, and the
// order of a stage's forwards and backwards.
#pragma once

#include <cstdint>
#include <vector>

#include "config/model_config.h"
#include "config/pipeline_layout.h"

namespace headroom {

// One slot of a stage's schedule: the forward or the backward of micro-batch `micro`.
struct PipelineSlot {
  bool forward = true;
  int64_t micro = 0;
  bool operator==(const PipelineSlot&) const = default;
};

// 1F1B (PipeDream-Flush, as Megatron-LM schedules it): stage s of p runs min(p - 1 - s, m) forwards
// first, then alternates one forward and one backward, then the remaining backwards. Stage s holds
// at most min(p - s, m) micro-batches' activations at once, the first stage the most.
std::vector<PipelineSlot> one_f_one_b(int64_t stage, int64_t stages, int64_t micro_batches);

// The parameters of each layer, of the embeddings and of the head (with the final norm, and with
// tied embeddings the last stage's copy of them), counted on a model without memory (the last few
// models' counts kept by each thread; safe to call from several threads).
struct StageParameters {
  std::vector<int64_t> layers;
  int64_t embeddings = 0, head = 0;
};
StageParameters stage_parameters(const ModelConfig& model);

// Each stage's layers for `model` (--pipeline-split, or the cut balancing parameters); throws Error
// for a layout the model cannot take. The run's default cut balances memory (estimate/pipeline_cut.h)
// and reaches here as a split.
std::vector<LayerRange> pipeline_stages(const ModelConfig& model, const PipelineLayout& layout);

}  // namespace headroom
