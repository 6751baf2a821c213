// SmolLM3 (SmolLM3ForCausalLM): Llama's layout, in which every no_rope_layer_interval-th layer
// (the 4th, 8th, ...) attends without rotary position embeddings ("NoPE"); no_rope_layers says
// per layer (1: rotary, 0: none) and, when absent, follows the interval. A sliding window, when
// set, applies to the layers without rotary, as transformers' layer_types derive it.
#include "config/family_readers.h"

namespace headroom::config_reading {

void read_smollm3(FieldReader& r, ModelConfig& c, const std::string& origin) {
  read_decoder_core(r, c, origin, 2000000.0);
  c.qkv_bias = c.out_bias = r.boolean_or("attention_bias", false);
  c.mlp_bias = r.boolean_or("mlp_bias", false);
  const int64_t interval = r.integer_or("no_rope_layer_interval", 4);
  if (interval < 1) fail("{}: no_rope_layer_interval is {}; accepted: 1 or more", origin, interval);
  c.rope_layers.clear();
  if (r.has("no_rope_layers")) {
    // A list longer than the layers (a config shrunk with --set num_hidden_layers) is cut to them.
    const nlohmann::json& flags = r.raw("no_rope_layers");
    if (!flags.is_array() || static_cast<int64_t>(flags.size()) < c.num_layers) {
      fail("{}: no_rope_layers must be a list of at least num_hidden_layers ({}) entries of 0 or 1", origin,
           c.num_layers);
    }
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const nlohmann::json& f = flags.at(static_cast<size_t>(i));
      if (!f.is_number_integer() || (f.get<int64_t>() != 0 && f.get<int64_t>() != 1)) {
        fail("{}: no_rope_layers[{}] is {}; accepted: 1 (rotary) or 0 (none)", origin, i, dump_json(f));
      }
      c.rope_layers.push_back(f.get<int64_t>() == 1);
    }
  } else {
    for (int64_t i = 0; i < c.num_layers; ++i) c.rope_layers.push_back((i + 1) % interval != 0);
  }
  if (r.boolean_or("use_sliding_window", false) && r.has("sliding_window")) {
    c.sliding_window = r.integer("sliding_window");
    if (!read_layer_types(r, c, origin)) {
      c.sliding_layers.clear();
      for (bool rotary : c.rope_layers) c.sliding_layers.push_back(!rotary);
    }
  } else {
    r.has("layer_types");  // without a window every layer is full attention
    r.has("sliding_window");
  }
}

}  // namespace headroom::config_reading
