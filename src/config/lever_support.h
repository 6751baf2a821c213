// Which of the step's levers (config/step_settings.h) combine, for a model: what train, estimate and
// plan refuse alike, so that no command prints a number for a run the trainer would not run.
// Checked once the model's config is known; the settings' own ranges are checked where they are
// parsed (config/run_config.cpp's validate).
#pragma once

#include "config/model_config.h"
#include "config/step_settings.h"

namespace headroom {

// Throws Error (one line naming the flags and what is accepted) for a combination not supported.
// `data_ranks`: the data-parallel ranks the settings' shard level works over (of a stage or share).
void check_lever_support(const StepSettings& s, const ModelConfig& model, int64_t data_ranks);
// The same as a yes or no (the planner and the doctor leave out what train would refuse).
bool levers_combine(const StepSettings& s, const ModelConfig& model, int64_t data_ranks);

}  // namespace headroom
