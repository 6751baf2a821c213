// OLMo-2 (Olmo2ForCausalLM): Llama's attention and MLP with the norms after them instead of
// before — x + norm(attention(x)), then h + norm(mlp(h)) — and an RMS norm of the whole query and
// key projections (over heads · head_dim) before rotary.
#include "config/family_readers.h"

namespace headroom::config_reading {

void read_olmo2(FieldReader& r, ModelConfig& c, const std::string& origin) {
  read_decoder_core(r, c, origin);
  c.qkv_bias = c.out_bias = r.boolean_or("attention_bias", false);
  c.qk_norm = QkNorm::whole;
  c.norm_placement = NormPlacement::post;
}

}  // namespace headroom::config_reading
