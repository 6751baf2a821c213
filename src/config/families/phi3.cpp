// Phi-3 (Phi3ForCausalLM): Llama's layer with the q, k and v projections fused into one (q rows,
// then k, then v) and the gate and up projections fused into one (the gate its first half);
// partial rotary and dropout on the embeddings and on each residual branch. LongRoPE (the 128k
// variants) is refused by the rotary reader.
#include <cmath>

#include "config/family_readers.h"

namespace headroom::config_reading {

void read_phi3(FieldReader& r, ModelConfig& c, const std::string& origin) {
  read_decoder_core(r, c, origin);
  c.fused_qkv = true;
  c.fused_gate_up = true;
  const double partial = r.number_or("partial_rotary_factor", rope_parameter(r, "partial_rotary_factor", 1.0, origin));
  if (partial <= 0 || partial > 1) {
    fail("{}: partial_rotary_factor must be in (0, 1], got {}", origin, partial);
  }
  c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * partial);
  r.has("original_max_position_embeddings");  // LongRoPE's; read with rope_scaling
  if (r.has("sliding_window")) c.sliding_window = r.integer("sliding_window");
  c.embd_dropout = r.number_or("embd_pdrop", 0.0);
  c.resid_dropout = r.number_or("resid_pdrop", 0.0);
}

}  // namespace headroom::config_reading
