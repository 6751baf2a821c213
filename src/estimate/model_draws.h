// ModelDraws — the whole model's parameters, name and elements in registration order, as a
// pipeline stage's initialisation draws them (each stage draws every parameter of the model from the
// seed and keeps its own; estimate/layer_replay.h replays those draws).
//
// Built from the trainer's own model class on the meta device once for a model and its settings,
// and kept for the next stage's replay: the planner replays about a dozen stages an estimate, and
// building all 80 layers of a 70B model for each was a tenth of its time. The last few models asked
// for are kept; safe to call from the planner's threads.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/base_weights.h"
#include "config/finetune.h"
#include "config/model_config.h"

namespace headroom {

using ModelDraws = std::vector<std::pair<std::string, int64_t>>;

std::shared_ptr<const ModelDraws> whole_model_draws(const ModelConfig& config, c10::ScalarType dtype,
                                                    const Finetune& finetune, BaseWeights base);

}  // namespace headroom
