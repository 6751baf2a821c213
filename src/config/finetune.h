// Finetune — which parameters a run trains (--finetune):
//   full                       every parameter (the default)
//   freeze:PATTERN[,PATTERN]   all but the parameters a glob names (`*` any run of characters, `?`
//                              one), matched against headroom's names (layers.3.attn.q_proj.weight)
//                              and Hugging Face's (model.layers.3.self_attn.q_proj.weight)
//   lora:r=R[,alpha=A][,dropout=P][,targets=q,k,v,o,gate,up,down]  (targets last; or joined by +)
//                              the base frozen whole, and a low-rank adapter trained beside each
//                              target projection, as peft's LoraConfig: y = W x + (B A dropout(x))
//                              · alpha / r, A (r × in) Kaiming-uniform, B (out × r) zeros. The
//                              defaults are peft's: alpha 8, dropout 0, targets q and v. A fused
//                              projection (gpt2's c_attn, Phi-3's qkv_proj and gate_up_proj) gets one
//                              adapter when any of its parts is a target, as peft adapts the module.
// Frozen parameters have no gradient and no optimizer state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace headroom {

// The projections LoRA can adapt, by role.
enum class Projection { q, k, v, o, gate, up, down };
inline constexpr int kProjections = 7;
const char* projection_name(Projection p);

struct LoraSettings {
  int64_t r = 8;
  double alpha = 8;
  double dropout = 0;
  std::vector<Projection> targets = {Projection::q, Projection::v};
  double scale() const { return alpha / static_cast<double>(r); }
  bool targets_any(std::initializer_list<Projection> ps) const;
  bool operator==(const LoraSettings&) const = default;
};

struct Finetune {
  enum class Kind { full, freeze, lora };
  Kind kind = Kind::full;
  std::vector<std::string> freeze;  // glob patterns
  LoraSettings lora;

  bool full() const { return kind == Kind::full; }
  bool is_lora() const { return kind == Kind::lora; }
  std::string name() const;  // as --finetune reads it back
  bool operator==(const Finetune&) const = default;
};

// Throws Error naming what is accepted.
Finetune parse_finetune(const std::string& text);

// `name` matches the glob `pattern` (`*`, `?`), whole.
bool glob_match(const std::string& pattern, const std::string& name);

}  // namespace headroom
