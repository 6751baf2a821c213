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

// Each stage's layers for `model` (by their parameters, or --pipeline-split); throws Error for a
// layout the model cannot take.
std::vector<LayerRange> pipeline_stages(const ModelConfig& model, const PipelineLayout& layout);

}  // namespace headroom
