// StageReplays — the replays of one pipeline estimate's stages, kept by stage and layers.
//
// A stage's replay depends on the step's settings, its index (the micro-batches it keeps in flight,
// whether it holds the embeddings or the head) and its own layers, not on how the other stages are
// cut. The default cut's search (estimate/pipeline_cut.h) replays stages of the parameters' cut and
// of cuts a layer away from it, and the estimate then replays the stages of the cut it chose
// (estimator.cpp's worst stage): a stage that holds the same layers in both is replayed once.
// Stages are replayed in live bytes; each keeps its allocations, so that a caching allocator's
// replay (reserved memory) is made for the one stage whose estimate is shown, when it is.
//
// The spec's own checks (estimator.cpp's) are the caller's: the stages are replayed unchecked. One
// estimate's, not shared between threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <tuple>
#include <vector>

#include "config/model_config.h"
#include "config/pipeline_layout.h"
#include "estimate/estimator.h"
#include "estimate/sim.h"

namespace headroom {

class StageReplays {
 public:
  // The estimate of stage `stage` of `spec` cut as `cut`, without a caching allocator.
  const Estimate& live(const ModelConfig& model, const TrainSpec& spec, const std::vector<LayerRange>& cut,
                       int64_t stage);
  // The same with the spec's caching allocator (reserved memory), where it has one.
  const Estimate& with_allocator(const ModelConfig& model, const TrainSpec& spec, const std::vector<LayerRange>& cut,
                                 int64_t stage);

 private:
  struct Replayed {
    Estimate live;
    std::vector<sim::Memory::Event> events;  // every allocation and release, for the reserved replay
    size_t step_begin = 0;                   // the step's first event
    std::optional<Estimate> with_allocator;
  };
  Replayed& replayed(const ModelConfig& model, const TrainSpec& spec, const std::vector<LayerRange>& cut,
                     int64_t stage);

  std::map<std::tuple<int64_t, int64_t, int64_t>, Replayed> done_;  // by stage, first and end layer
};

}  // namespace headroom
