// PipelineLayout — how a run's layers are cut into pipeline stages (lever 6, model parallelism),
// parsed once from --pipeline P and --pipeline-split. The machinery is dist/pipeline.h.
//
// Stage s holds layers [first, end) of its range; the embeddings sit on the first stage, the final
// norm, the head and the loss on the last (and, with tied embeddings, a copy of the embedding there
// as its head, kept equal to the first stage's).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace headroom {

struct LayerRange {
  int64_t first = 0, end = 0;  // layers [first, end)
  bool operator==(const LayerRange&) const = default;
};

struct PipelineLayout {
  int64_t stages = 1;             // --pipeline: 1 is no pipeline
  std::vector<LayerRange> split;  // --pipeline-split; empty: balanced (stage_ranges)
  bool operator==(const PipelineLayout&) const = default;
};

// "0:12,12:24": contiguous ranges from layer 0, each non-empty. Throws Error naming the accepted
// form. The text of a split, as parse_pipeline_split reads it back.
std::vector<LayerRange> parse_pipeline_split(const std::string& text);
std::string pipeline_split_text(const std::vector<LayerRange>& split);

// The contiguous cut of `layers` layers into `stages` stages (each at least one layer) whose
// heaviest stage, by `weight(stage, first, end)` for layers [first, end), is the lightest; of those
// the most even (the smallest sum of squared weights), so that no stage is left nearly empty; of
// equally even ones, the one whose earlier stages (which keep more micro-batches in flight) hold
// fewer layers. Needs 1 <= stages <= layers.
std::vector<LayerRange> lightest_cut(int64_t layers, int64_t stages,
                                     const std::function<int64_t(int64_t stage, int64_t first, int64_t end)>& weight);

// The cut whose largest stage holds as few layers as any cut's can, ceil(layers / stages): the
// fastest by the planner's cost model, which paces a pipeline by its largest stage (plan/planner.h).
// The stages holding a layer more are the middle ones from the last but one down (the later keep
// fewer micro-batches in flight), then the last (it holds the head), then the first (the most in
// flight). Needs 1 <= stages <= layers.
std::vector<LayerRange> even_cut(int64_t layers, int64_t stages);

// Each stage's layers for a model of `layers` layers whose layer i holds `layer_params[i]`
// parameters (all equal for most models), the embeddings `embed_params` and the head (with the
// final norm) `head_params`: the split when one is given (checked against the model: its ranges
// must cover 0..layers and there must be `stages` of them), else the lightest_cut by parameters
// (a stage's layers plus, at the ends, the embeddings or the head). The run's default cut weighs
// memory instead (estimate/pipeline_cut.h), starting from this one. Throws Error when `stages`
// exceeds the layers, or the split does not fit the model.
std::vector<LayerRange> stage_ranges(const PipelineLayout& layout, const std::vector<int64_t>& layer_params,
                                     int64_t embed_params, int64_t head_params);

}  // namespace headroom
