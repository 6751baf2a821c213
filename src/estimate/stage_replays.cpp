#include "estimate/stage_replays.h"

#include "estimate/reserved.h"
#include "estimate/step_replay.h"

namespace headroom {

StageReplays::Replayed& StageReplays::replayed(const ModelConfig& model, const TrainSpec& spec,
                                               const std::vector<LayerRange>& cut, int64_t stage) {
  const LayerRange& mine = cut.at(static_cast<size_t>(stage));
  const auto key = std::make_tuple(stage, mine.first, mine.end);
  const auto found = done_.find(key);
  if (found != done_.end()) return found->second;
  TrainSpec one = spec;
  one.pipeline.split = cut;
  one.stage = stage;
  one.caching.reset();
  one.budget.reset();
  replay::StepReplay step(model, one);
  Replayed r;
  r.live = step.run();
  r.live.stage = stage;
  r.live.cut = cut;
  r.step_begin = step.step_begin();
  r.events = step.take_events();
  return done_.emplace(key, std::move(r)).first->second;
}

const Estimate& StageReplays::live(const ModelConfig& model, const TrainSpec& spec, const std::vector<LayerRange>& cut,
                                   int64_t stage) {
  return replayed(model, spec, cut, stage).live;
}

const Estimate& StageReplays::with_allocator(const ModelConfig& model, const TrainSpec& spec,
                                             const std::vector<LayerRange>& cut, int64_t stage) {
  Replayed& r = replayed(model, spec, cut, stage);
  if (!spec.caching) return r.live;
  if (spec.skips_reserved(r.live.peak_bytes)) return r.live;
  if (!r.with_allocator) {
    // As StepReplay::result replays them, under the spec's cap.
    r.with_allocator = r.live;
    r.with_allocator->reserved = replay_reserved(r.events, r.step_begin, replay::kReservedSteps, *spec.caching,
                                                 spec.budget);
  }
  return *r.with_allocator;
}

}  // namespace headroom
