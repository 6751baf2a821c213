#include "estimate/model_draws.h"

#include <deque>
#include <mutex>

#include "model/causal_lm.h"

namespace headroom {

std::shared_ptr<const ModelDraws> whole_model_draws(const ModelConfig& config, c10::ScalarType dtype,
                                                    const Finetune& finetune, BaseWeights base) {
  struct Kept {
    ModelConfig config;
    c10::ScalarType dtype;
    Finetune finetune;
    BaseWeights base;
    std::shared_ptr<const ModelDraws> draws;
  };
  constexpr size_t kModelsKept = 4;
  static std::mutex mutex;
  static std::deque<Kept> kept;  // the latest first
  {
    const std::lock_guard<std::mutex> lock(mutex);
    for (const Kept& k : kept) {
      if (k.dtype == dtype && k.base == base && k.finetune == finetune && k.config == config) return k.draws;
    }
  }
  const CausalLM whole(config, at::TensorOptions().device(at::kMeta).dtype(dtype), 0, CausalLM::KeepParameter{},
                       finetune, true, base);
  auto draws = std::make_shared<ModelDraws>();
  for (const auto& np : whole.parameters()) draws->emplace_back(np.name, np.tensor.numel());
  const std::lock_guard<std::mutex> lock(mutex);
  kept.push_front({config, dtype, finetune, base, draws});
  if (kept.size() > kModelsKept) kept.pop_back();
  return draws;
}

}  // namespace headroom
