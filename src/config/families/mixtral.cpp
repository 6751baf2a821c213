// Mixtral (MixtralForCausalLM): Mistral's attention (its optional sliding window) with every MLP
// replaced by num_local_experts experts, num_experts_per_tok per token, their routing weights
// always renormalised over the chosen ones.
#include "config/family_readers.h"

namespace headroom::config_reading {

void read_mixtral(FieldReader& r, ModelConfig& c, const std::string& origin) {
  read_decoder_core(r, c, origin, /*default_theta=*/1e6);
  if (r.has("sliding_window")) c.sliding_window = r.integer("sliding_window");
  MoeConfig moe;
  moe.experts = r.integer_or("num_local_experts", 8);
  moe.top_k = r.integer_or("num_experts_per_tok", 2);
  moe.intermediate_size = c.intermediate_size;
  moe.normalise_top_k = true;
  if (r.number_or("router_jitter_noise", 0.0) != 0.0) {
    fail("{}: router_jitter_noise other than 0 is not supported (it multiplies the hidden states by noise "
         "in training); accepted: 0",
         origin);
  }
  read_router_loss(r, moe, 0.001);
  c.moe = moe;
}

}  // namespace headroom::config_reading
