// The default cut of a pipeline (--pipeline P without --pipeline-split): the layers split so that
// the stage peaking highest, by the estimator's replay of each stage, peaks as low as it can.
//
// Stages differ in more than their layers: 1F1B keeps min(P - s, M) micro-batches' activations in
// flight on stage s, so the first stage holds the most; the first also holds the embeddings, the
// last the head and the loss. A cut balancing parameters (config/pipeline_layout.h's stage_ranges)
// leaves them uneven. From that cut: each stage's peak, replayed for the two ends and the first and
// last of each run of middle stages alike in layers (the others differ from those only in the
// micro-batches they keep, and are read off the line through them in that count, as every_stage =
// false reasons); and what a layer costs on a stage (its weights, gradients and optimizer state,
// and its activations times the micro-batches in flight), replayed with one layer traded with a
// neighbour at the two ends and the first and last middle stages, read off the line for the rest,
// and taken in proportion to a layer's parameters. The cut whose largest predicted stage is
// smallest (config/pipeline_layout.h's lightest_cut) is the proposal; the estimate replays it in
// its turn, and keeps it when its highest stage peaks below the parameters' cut's.
//
// About ten stage replays, whatever P: milliseconds for small models, about a second for a 70B one
// in 64 stages. They are live bytes only, kept (estimate/stage_replays.h) for the estimate's replay
// of the cut it chooses, which makes again only the stages whose layers differ.
#pragma once

#include <vector>

#include "config/model_config.h"
#include "config/pipeline_layout.h"
#include "estimate/estimator.h"
#include "estimate/stage_replays.h"

namespace headroom {

// The search, before its result is replayed: `layers` the cut it proposes, `by_parameters` where it
// started, with its largest stage's peak (0 where there was nothing to search: a given split, or
// the only cut). estimate() replays the proposal and keeps the parameters' cut where the proposal
// does not peak lower.
struct CutProposal {
  std::vector<LayerRange> layers, by_parameters;
  int64_t by_parameters_peak = 0;
};
// The stages it replays are kept in `replays`, for the estimate's own replay of the cut it chooses.
CutProposal propose_balanced_cut(const ModelConfig& model, const TrainSpec& spec, StageReplays& replays);

// The layers of each of spec.pipeline.stages stages for `spec`'s step, as estimate() cuts them: the
// split when spec gives one, else the proposal or the parameters' cut, whichever peaks lower.
// Throws Error for a layout the model cannot take.
std::vector<LayerRange> memory_balanced_cut(const ModelConfig& model, const TrainSpec& spec);

}  // namespace headroom
