#include "dist/pipeline_schedule.h"

#include <ATen/ATen.h>

#include <algorithm>

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

std::vector<LayerRange> pipeline_stages(const ModelConfig& model, const PipelineLayout& layout) {
  // The parameters of each layer, of the embeddings and of the head, from a model without memory.
  const CausalLM meta(model, at::TensorOptions().device(at::kMeta).dtype(at::kFloat), 0);
  std::vector<int64_t> layer_params(static_cast<size_t>(model.num_layers), 0);
  int64_t embed = 0, head = 0;
  for (const NamedTensor& p : meta.parameters()) {
    const int64_t n = meta.counted_elements(p);
    if (p.name.rfind("layers.", 0) == 0) {
      layer_params[std::stoul(p.name.substr(7, p.name.find('.', 7) - 7))] += n;
    } else if (p.name.rfind("embed_", 0) == 0) {
      embed += n;
    } else {
      head += n;
    }
  }
  if (model.tie_word_embeddings) head += model.vocab_size * model.hidden_size;  // the last stage's copy
  return stage_ranges(layout, layer_params, embed, head);
}

}  // namespace headroom
