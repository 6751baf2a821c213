#include "estimate/meta_models.h"

#include <deque>

namespace headroom {
namespace {

// The parts of a ModelStage that decide its parameters (not the tensor-parallel collectives, unset
// on the meta device).
bool same_part(const ModelStage& a, const ModelStage& b) {
  return a.first == b.first && a.end == b.end && a.embeddings == b.embeddings && a.head == b.head &&
         a.tensor.rank == b.tensor.rank && a.tensor.ranks == b.tensor.ranks && a.tensor.sequence == b.tensor.sequence;
}

}  // namespace

std::shared_ptr<const CausalLM> meta_model(const ModelConfig& config, c10::ScalarType dtype, const Finetune& finetune,
                                           BaseWeights base, const ModelStage& stage) {
  struct Kept {
    ModelConfig config;
    c10::ScalarType dtype;
    Finetune finetune;
    BaseWeights base;
    ModelStage stage;
    std::shared_ptr<const CausalLM> model;
  };
  // Each thread keeps its own (a lock shared by the planner's threads was waited on more than the
  // models took to build), the latest asked for first.
  thread_local std::deque<Kept> kept;
  for (auto k = kept.begin(); k != kept.end(); ++k) {
    if (k->dtype == dtype && k->base == base && same_part(k->stage, stage) && k->finetune == finetune &&
        k->config == config) {
      if (k != kept.begin()) {
        Kept found = std::move(*k);
        kept.erase(k);
        kept.push_front(std::move(found));
      }
      return kept.front().model;
    }
  }
  auto model = std::make_shared<const CausalLM>(config, at::TensorOptions().device(at::kMeta).dtype(dtype), 0,
                                                CausalLM::KeepParameter{}, finetune, true, base, stage);
  ModelStage part = stage;
  part.tensor.allreduce = nullptr;
  part.tensor.allgather = part.tensor.reduce_scatter = nullptr;
  kept.push_front({config, dtype, finetune, base, part, model});
  if (kept.size() > kMetaModelsKept) kept.pop_back();
  return model;
}

}  // namespace headroom
