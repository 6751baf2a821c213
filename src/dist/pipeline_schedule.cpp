#include "dist/pipeline_schedule.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <deque>
#include <utility>

#include "model/causal_lm.h"

namespace headroom {

std::vector<PipelineSlot> one_f_one_b(int64_t stage, int64_t stages, int64_t micro_batches) {
  const int64_t warmup = std::min(stages - 1 - stage, micro_batches);
  std::vector<PipelineSlot> out;
  out.reserve(static_cast<size_t>(2 * micro_batches));
  int64_t forwards = 0, backwards = 0;
  for (; forwards < warmup; ++forwards) out.push_back({true, forwards});
  while (forwards < micro_batches) {
    out.push_back({true, forwards++});
    out.push_back({false, backwards++});
  }
  while (backwards < micro_batches) out.push_back({false, backwards++});
  return out;
}

StageParameters stage_parameters(const ModelConfig& model) {
  // The last few models' counts, kept: the planner asks twice an estimate (the default cut and its
  // proposal, estimate/pipeline_cut.h), and counting builds the whole model on the meta device.
  thread_local std::deque<std::pair<ModelConfig, StageParameters>> kept;  // each thread's, the latest first
  for (const auto& [config, counts] : kept) {
    if (config == model) return counts;
  }
  const CausalLM meta(model, at::TensorOptions().device(at::kMeta).dtype(at::kFloat), 0);
  StageParameters out;
  out.layers.assign(static_cast<size_t>(model.num_layers), 0);
  for (const NamedTensor& p : meta.parameters()) {
    const int64_t n = meta.counted_elements(p);
    if (p.name.rfind("layers.", 0) == 0) {
      out.layers[std::stoul(p.name.substr(7, p.name.find('.', 7) - 7))] += n;
    } else if (p.name.rfind("embed_", 0) == 0) {
      out.embeddings += n;
    } else {
      out.head += n;
    }
  }
  if (model.tie_word_embeddings) out.head += model.vocab_size * model.hidden_size;  // the last stage's copy
  kept.emplace_front(model, out);
  if (kept.size() > 4) kept.pop_back();
  return out;
}

std::vector<LayerRange> pipeline_stages(const ModelConfig& model, const PipelineLayout& layout) {
  if (!layout.split.empty() || layout.stages == 1) {
    return stage_ranges(layout, std::vector<int64_t>(static_cast<size_t>(model.num_layers), 1), 0, 0);
  }
  const StageParameters params = stage_parameters(model);
  return stage_ranges(layout, params.layers, params.embeddings, params.head);
}

}  // namespace headroom
