#include "model/lora.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

namespace headroom {

std::vector<AdaptableModule> adaptable_modules(const ModelConfig& c, int64_t layer) {
  using P = Projection;
  const std::string p = fmt::format("layers.{}.", layer);
  const int64_t d = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const int64_t inter = c.intermediate_size;
  std::vector<AdaptableModule> out;
  if (c.fused_qkv) {
    out.push_back({p + "attn.qkv.weight", q + 2 * kv, d, {P::q, P::k, P::v}});
  } else {
    out.push_back({p + "attn.q_proj.weight", q, d, {P::q}});
    out.push_back({p + "attn.k_proj.weight", kv, d, {P::k}});
    out.push_back({p + "attn.v_proj.weight", kv, d, {P::v}});
  }
  out.push_back({p + "attn.o_proj.weight", d, q, {P::o}});
  if (c.sparse(layer)) return out;
  if (c.fused_gate_up) {
    out.push_back({p + "mlp.gate_up_proj.weight", 2 * inter, d, {P::gate, P::up}});
  } else {
    if (c.gated_mlp) out.push_back({p + "mlp.gate_proj.weight", inter, d, {P::gate}});
    out.push_back({p + "mlp.up_proj.weight", inter, d, {P::up}});
  }
  out.push_back({p + "mlp.down_proj.weight", d, inter, {P::down}});
  return out;
}

namespace {
std::string adapter_name(const std::string& weight, const char* which) {
  return weight.substr(0, weight.size() - std::string(".weight").size()) + "." + which + ".weight";
}
}  // namespace

bool is_lora_parameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

std::string lora_a_name(const std::string& weight) { return adapter_name(weight, "lora_A"); }
std::string lora_b_name(const std::string& weight) { return adapter_name(weight, "lora_B"); }

int64_t lora_parameters(const ModelConfig& c, const LoraSettings& lora) {
  int64_t n = 0;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    for (const AdaptableModule& m : adaptable_modules(c, i)) {
      bool targeted = false;
      for (Projection role : m.roles) targeted |= lora.targets_any({role});
      if (targeted) n += lora.r * (m.in + m.out);
    }
  }
  return n;
}

at::Tensor lora_project(const at::Tensor& x, const at::Tensor& y, const LoraAdapter& adapter, const LoraSettings& lora,
                        bool training) {
  if (!adapter.defined()) return y;
  const at::Tensor in = training && lora.dropout > 0 ? at::dropout(x, lora.dropout, true) : x;
  return y + at::linear(at::linear(in, adapter.a), adapter.b) * lora.scale();
}

}  // namespace headroom
