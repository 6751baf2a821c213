#include "train/step_ops.h"

#include <ATen/ATen.h>

#include "model/chunked_loss.h"

namespace headroom {

void seed_step(uint64_t seed, int64_t step, int rank) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step) + 1 +
               static_cast<uint64_t>(rank) * 0xD1B54A32D192ED03ull;
  x = (x ^ (x >> 31)) * 0xBF58476D1CE4E5B9ull;
  at::manual_seed(x >> 1);
}

at::Tensor token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}));
}

namespace {

// The loss of the model's logits: tensor parallel, of this rank's vocabulary rows.
at::Tensor logits_loss(const CausalLM& model, const at::Tensor& logits, const at::Tensor& targets) {
  const TensorSlice& tp = model.tensor_slice();
  return tp.whole() ? token_loss(logits, targets)
                    : parallel_token_loss(logits, targets, tp, model.config().vocab_size);
}

}  // namespace

at::Tensor model_loss(const CausalLM& model, const at::Tensor& inputs, const at::Tensor& targets,
                      const ForwardOptions& options, const LossSetting& loss, RouterOutput* router, at::Tensor* outputs) {
  if (!loss.chunked) {
    const at::Tensor logits = model.forward(inputs, options, router);
    if (outputs) *outputs = logits;
    return logits_loss(model, logits, targets);
  }
  const at::Tensor hidden = model.hidden_states(inputs, options, router);
  if (outputs) *outputs = hidden;
  return head_loss(model, hidden, targets, loss);
}

at::Tensor head_loss(const CausalLM& model, const at::Tensor& hidden, const at::Tensor& targets,
                     const LossSetting& loss) {
  if (!loss.chunked) return logits_loss(model, model.head(hidden), targets);
  TORCH_CHECK(model.tensor_slice().whole(), "--loss chunked with --tensor-parallel: not supported");
  const ModelConfig& c = model.config();
  const int64_t chunk = chunk_tokens(loss, targets.numel(), c.vocab_size, c.hidden_size);
  return chunked_token_loss(hidden, model.head_weight(), targets, chunk);
}

}  // namespace headroom
