// MetaModels — the trainer's own model class built on the meta device (shapes, nothing allocated),
// once for a model, its settings and the part of it a rank holds, and shared by every replay that
// asks for the same: the planner replays a dozen pipeline stages an estimate and a thousand
// estimates a search, most of them of parts built before, and building a stage of a 70B model
// (or, for its draws, the whole model: estimate/layer_replay.h) was a fifth of a search's time.
//
// The last models asked for are kept (kMetaModelsKept), by each thread; safe to call from the
// planner's threads. A kept model is never changed: its users read its parameters' shapes and make
// new tensors from them, and may hold it after it is no longer kept.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <memory>

#include "config/base_weights.h"
#include "config/finetune.h"
#include "config/model_config.h"
#include "model/causal_lm.h"

namespace headroom {

inline constexpr size_t kMetaModelsKept = 256;

// `config` built in `dtype` on the meta device, as CausalLM(config, meta, seed 0, {}, finetune, true,
// base, stage) builds it; `stage` {} is the whole model.
std::shared_ptr<const CausalLM> meta_model(const ModelConfig& config, c10::ScalarType dtype, const Finetune& finetune,
                                           BaseWeights base, const ModelStage& stage = {});

}  // namespace headroom
