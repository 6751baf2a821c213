// The operator table's cases (ops_test.cpp): each modelled operator called for real and replayed,
// at the shapes below. Data: one case per operator and setting.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "config/model_config.h"
#include "device/autocast_adapter.h"
#include "estimate/ops_test_harness.h"
#include "model/attention.h"
#include "model/chunked_loss.h"
#include "model/experts.h"
#include "model/rotary.h"
#include "model/tensor_parallel.h"
#include "train/precision.h"
#include "train/step_ops.h"

namespace headroom::operator_table {

constexpr int64_t B = 2, T = 64, H = 256, F = 688, V = 320, HEADS = 8, HD = 32;

// q, k, v as the model makes them: [B, T, heads·hd] projections seen as [B, heads, T, hd].
inline at::Tensor heads_of(const at::Tensor& x, int64_t heads) { return x.view({B, T, heads, HD}).transpose(1, 2); }
inline at::Tensor merged(const at::Tensor& y) { return y.transpose(1, 2).reshape({B, T, HEADS * HD}); }

inline std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"cast", "float32 -> bfloat16",
               [] {
                 return measure_real(
                     [] {
                       return std::vector<at::Tensor>{leaf({B, T, H})};
                     },
                     [](const auto& in) { return in[0].to(at::kBFloat16); });
               },
               [] {
                 Replay r(false);
                 auto x = r.leaf(B * T * H, 4);
                 return r.measure([&] { return r.cast(x, 2, r.label()); });
               }});
  for (bool bias : {false, true}) {
    c.push_back({"linear", fmt::format("float32 [B, T, {}] x [{}, {}]{}", H, F, H, bias ? " + bias" : ""),
                 [bias] {
                   return measure_real(
                       [bias] {
                         std::vector<at::Tensor> in{leaf({B, T, H}), leaf({F, H})};
                         if (bias) in.push_back(leaf({F}));
                         return in;
                       },
                       [bias](const auto& in) { return at::linear(in[0], in[1], bias ? in[2] : at::Tensor()); });
                 },
                 [bias] {
                   Replay r(false);
                   auto x = r.leaf(B * T * H, 4);
                   auto w = r.param(F, H, 4);
                   auto b = r.param(F, 0, 4);
                   return r.measure([&] { return r.linear(x, w, bias ? &b : nullptr, r.label()); });
                 }});
  }
  c.push_back({"linear", "under bf16 autocast: 2-byte copies of the input and the weight",
               [] {
                 return measure_real(
                     [] {
                       return std::vector<at::Tensor>{leaf({B, T, H}), leaf({F, H})};
                     },
                     [](const auto& in) {
                       const AutocastScope autocast(c10::DeviceType::CPU, forward_autocast(Precision::bf16_mixed));
                       return at::linear(in[0], in[1]);
                     });
               },
               [] {
                 Replay r(true);
                 auto x = r.leaf(B * T * H, 4);
                 auto w = r.param(F, H, 4);
                 return r.measure([&] { return r.linear(x, w, nullptr, r.label()); });
               }});
  c.push_back({"add", "[B, T, H] + [T, H] (positions broadcast)",
               [] {
                 return measure_real(
                     [] {
                       return std::vector<at::Tensor>{leaf({B, T, H}), leaf({T, H})};
                     },
                     [](const auto& in) { return in[0] + in[1]; });
               },
               [] {
                 Replay r(false);
                 auto a = r.leaf(B * T * H, 4);
                 auto b = r.leaf(T * H, 4);
                 return r.measure([&] { return r.add(a, b, r.label()); });
               }});
  c.push_back({"add", "residual: [B, T, H] + [B, T, H]",
               [] {
                 return measure_real(
                     [] {
                       return std::vector<at::Tensor>{leaf({B, T, H}), leaf({B, T, H})};
                     },
                     [](const auto& in) { return in[0] + in[1]; });
               },
               [] {
                 Replay r(false);
                 auto a = r.leaf(B * T * H, 4);
                 auto b = r.leaf(B * T * H, 4);
                 return r.measure([&] { return r.add(a, b, r.label()); });
               }});
  c.push_back({"mul", "gate * up",
               [] {
                 return measure_real(
                     [] {
                       return std::vector<at::Tensor>{leaf({B, T, F}), leaf({B, T, F})};
                     },
                     [](const auto& in) { return in[0] * in[1]; });
               },
               [] {
                 Replay r(false);
                 auto a = r.leaf(B * T * F, 4);
                 auto b = r.leaf(B * T * F, 4);
                 return r.measure([&] { return r.mul(a, b, r.label()); });
               }});
  c.push_back({"scale", "x * 0.5",
               [] {
                 return measure_real(
                     [] {
                       return std::vector<at::Tensor>{leaf({B, T, H})};
                     },
                     [](const auto& in) { return in[0] * 0.5; });
               },
               [] {
                 Replay r(false);
                 auto x = r.leaf(B * T * H, 4);
                 return r.measure([&] { return r.scale(x, r.label()); });
               }});
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const int e = dtype == at::kFloat ? 4 : 2;
    c.push_back({"rms_norm", std::string(c10::toString(dtype)),
                 [dtype] {
                   return measure_real(
                       [dtype] {
                         return std::vector<at::Tensor>{leaf({B, T, H}, dtype), leaf({H}, dtype)};
                       },
                       [](const auto& in) { return at::rms_norm(in[0], {H}, in[1], 1e-5); });
                 },
                 [e] {
                   Replay r(false);
                   auto x = r.leaf(B * T * H, e);
                   auto w = r.param(H, 0, e);
                   return r.measure([&] { return r.rms_norm(x, w); });
                 }});
    // Gemma's: the weight used is 1 + w; and per head (a q/k norm over head_dim).
    c.push_back({"rms_norm", std::string(c10::toString(dtype)) + ", 1 + w, per head of " + std::to_string(HD),
                 [dtype] {
                   return measure_real(
                       [dtype] {
                         return std::vector<at::Tensor>{leaf({B, T, HEADS, HD}, dtype), leaf({HD}, dtype)};
                       },
                       [](const auto& in) { return at::rms_norm(in[0], {HD}, in[1] + 1, 1e-6); });
                 },
                 [e] {
                   Replay r(false);
                   auto x = r.leaf(B * T * HEADS * HD, e);
                   auto w = r.param(HD, 0, e);
                   return r.measure([&] { return r.rms_norm(x, w, true); });
                 }});
    c.push_back({"layer_norm", std::string(c10::toString(dtype)),
                 [dtype] {
                   return measure_real(
                       [dtype] {
                         return std::vector<at::Tensor>{leaf({B, T, H}, dtype), leaf({H}, dtype), leaf({H}, dtype)};
                       },
                       [](const auto& in) { return at::layer_norm(in[0], {H}, in[1], in[2], 1e-5); });
                 },
                 [e] {
                   Replay r(false);
                   auto x = r.leaf(B * T * H, e);
                   auto w = r.param(H, 0, e);
                   auto b = r.param(H, 0, e);
                   return r.measure([&] { return r.layer_norm(x, w, &b); });
                 }});
  }
  for (const char* fn : {"silu", "gelu_tanh", "gelu", "relu"}) {
    const std::string name = fn;
    c.push_back({"activation", name,
                 [name] {
                   return measure_real(
                       [] {
                         return std::vector<at::Tensor>{leaf({B, T, F})};
                       },
                       [name](const auto& in) {
                         if (name == "silu") return at::silu(in[0]);
                         if (name == "relu") return at::relu(in[0]);
                         return name == "gelu" ? at::gelu(in[0]) : at::gelu(in[0], "tanh");
                       });
                 },
                 [name] {
                   Replay r(false);
                   auto x = r.leaf(B * T * F, 4);
                   return r.measure([&] { return r.activation(x, name == "relu"); });
                 }});
  }
  c.push_back({"dropout", "p = 0.1, training",
               [] {
                 return measure_real(
                     [] {
                       return std::vector<at::Tensor>{leaf({B, T, H})};
                     },
                     [](const auto& in) { return at::dropout(in[0], 0.1, true); });
               },
               [] {
                 Replay r(false);
                 auto x = r.leaf(B * T * H, 4);
                 return r.measure([&] { return r.dropout(x, 0.1, r.label()); });
               }});
  for (const char* preset : {"tiny", "pythia-160m"}) {
    const ModelConfig mc = load_model_config(preset, {"hidden_size=256", "num_attention_heads=8"});  // head_dim 32
    c.push_back({"rotary", fmt::format("{} (rotary_dim {} of head_dim {})", preset, mc.rotary_dim, HD),
                 [mc] {
                   const Rotary rotary(mc);
                   const auto [cos, sin] = rotary.tables(T, at::kCPU);
                   return measure_real(
                       [] {
                         return std::vector<at::Tensor>{leaf({B, T, HEADS * HD})};
                       },
                       [&](const auto& in) { return rotary.apply(heads_of(in[0], HEADS), cos, sin); });
                 },
                 [mc] {
                   Replay r(false);
                   auto cos = r.constant(T * mc.rotary_dim, 4), sin = r.constant(T * mc.rotary_dim, 4);
                   auto q = r.leaf(B * T * HEADS * HD, 4);
                   return r.measure([&] { return r.rotary(q, HEADS, HD, mc.rotary_dim, cos, sin); });
                 }});
  }
  c.push_back({"embedding", "[V, H] table, B x T ids",
               [] {
                 const at::Tensor ids = at::randint(V, {B, T}, at::TensorOptions().dtype(at::kLong));
                 return measure_real(
                     [] {
                       return std::vector<at::Tensor>{leaf({V, H})};
                     },
                     [&](const auto& in) { return at::embedding(in[0], ids); });
               },
               [] {
                 Replay r(false);
                 auto table = r.param(V, H, 4);
                 return r.measure([&] { return r.embedding(table, B * T, 4, r.label()); });
               }});
  c.push_back({"token_loss", "float32 cross-entropy over a narrow of the batch's tokens",
               [] {
                 const at::Tensor batch = at::randint(V, {B, T + 1}, at::TensorOptions().dtype(at::kLong));
                 return measure_real(
                     [] {
                       return std::vector<at::Tensor>{leaf({B, T, V})};
                     },
                     [&](const auto& in) { return token_loss(in[0], batch.narrow(1, 1, T)); });
               },
               [] {
                 Replay r(false);
                 auto logits = r.leaf(B * T * V, 4);
                 return r.measure([&] { return r.token_loss(logits, B * T, V, r.input_label(), r.label()); });
               }});
  // model/tensor_parallel.h's vocabulary-split embedding and loss, on one share (the whole
  // vocabulary, the collective a no-op): what each allocates does not depend on the ranks.
  static TensorSlice one_share;
  one_share.allreduce = [](at::Tensor&, bool) {};
  c.push_back({"parallel_embedding", "[V, H] share of the table, B x T ids",
               [] {
                 const at::Tensor ids = at::randint(V, {B, T}, at::TensorOptions().dtype(at::kLong));
                 return measure_real([] { return std::vector<at::Tensor>{leaf({V, H})}; },
                                     [&](const auto& in) { return parallel_embedding(in[0], ids, one_share, V); });
               },
               [] {
                 Replay r(false);
                 auto table = r.param(V, H, 4);
                 return r.measure([&] { return r.parallel_embedding(table, B * T, 4, r.label()); });
               }});
  for (bool bf16 : {false, true}) {
    c.push_back({"parallel_token_loss", fmt::format("{} logits of a share, a narrow of the batch's tokens",
                                                    bf16 ? "bf16" : "float32"),
                 [bf16] {
                   const at::Tensor batch = at::randint(V, {B, T + 1}, at::TensorOptions().dtype(at::kLong));
                   return measure_real(
                       [bf16] { return std::vector<at::Tensor>{leaf({B, T, V}, bf16 ? at::kBFloat16 : at::kFloat)}; },
                       [&](const auto& in) { return parallel_token_loss(in[0], batch.narrow(1, 1, T), one_share, V); });
                 },
                 [bf16] {
                   Replay r(false);
                   auto logits = r.leaf(B * T * V, bf16 ? 2 : 4);
                   return r.measure(
                       [&] { return r.parallel_token_loss(logits, B * T, V, r.input_label(), r.label()); });
                 }});
  }
  // model/chunked_loss.h: chunks of 48 of the 128 tokens (the last one short), in float32, under
  // bf16 autocast (2-byte copies of the hidden states and the head), pure bf16, and with a frozen head.
  struct ChunkedCase {
    const char* what;
    bool mixed, bf16, head_grad;
  };
  for (const ChunkedCase& k : {ChunkedCase{"float32", false, false, true}, ChunkedCase{"bf16 autocast", true, false, true},
                               ChunkedCase{"pure bf16", false, true, true},
                               ChunkedCase{"bf16 autocast, frozen head", true, false, false}}) {
    constexpr int64_t kChunk = 48;
    c.push_back({"chunked_loss", fmt::format("{}: [B·T, {}] through [{}, {}], chunks of {}", k.what, H, V, H, kChunk),
                 [k] {
                   const at::Tensor batch = at::randint(V, {B, T + 1}, at::TensorOptions().dtype(at::kLong));
                   const at::ScalarType dt = k.bf16 ? at::kBFloat16 : at::kFloat;
                   return measure_real(
                       [dt, k] {
                         at::Tensor w = at::randn({V, H}, at::TensorOptions().dtype(dt)).requires_grad_(k.head_grad);
                         return std::vector<at::Tensor>{leaf({B, T, H}, dt), w};
                       },
                       [&batch, k](const auto& in) {
                         const AutocastScope autocast(c10::DeviceType::CPU,
                                                      forward_autocast(k.mixed ? Precision::bf16_mixed : Precision::fp32));
                         return chunked_token_loss(in[0], in[1], batch.narrow(1, 1, T), kChunk);
                       });
                 },
                 [k] {
                   Replay r(k.mixed);
                   const int elem = k.bf16 ? 2 : 4;
                   auto x = r.leaf(B * T * H, elem);
                   sim::Param w = k.head_grad ? r.param(V, H, elem) : sim::Param{r.constant(V * H, elem), V, H};
                   return r.measure([&] { return r.chunked_loss(x, w, B * T, kChunk, r.input_label(), r.label()); });
                 }});
  }
  // A mixture of experts (model/experts.cpp) on real routing: the model is told the loads the
  // router really produced for these inputs.
  for (bool mixed : {false, true}) {
    constexpr int64_t E = 4, K = 2, FE = 96;
    auto inputs = [] {
      at::manual_seed(11);
      std::vector<at::Tensor> in{leaf({B, T, H}), leaf({E, H})};
      for (int64_t e = 0; e < E; ++e) {
        in.push_back(leaf({FE, H}));
        in.push_back(leaf({FE, H}));
        in.push_back(leaf({H, FE}));
      }
      return in;
    };
    auto experts_of = [](const std::vector<at::Tensor>& in) {
      std::vector<Expert> ex;
      for (int64_t e = 0; e < E; ++e) ex.push_back({in[2 + 3 * e], in[3 + 3 * e], in[4 + 3 * e]});
      return ex;
    };
    MoeConfig moe;
    moe.experts = E;
    moe.top_k = K;
    moe.intermediate_size = FE;
    moe.normalise_top_k = true;
    c.push_back({"mixture_of_experts", fmt::format("{} experts, top {}, renormalised{}", E, K,
                                                   mixed ? ", under bf16 autocast" : ""),
                 [=] {
                   return measure_real(inputs, [=](const auto& in) {
                     const AutocastScope autocast(c10::DeviceType::CPU,
                                                  forward_autocast(mixed ? Precision::bf16_mixed : Precision::fp32));
                     return mixture_of_experts(in[0], in[1], experts_of(in), moe, Activation::silu, nullptr);
                   });
                 },
                 [=] {
                   std::vector<int64_t> loads;
                   {
                     const c10::NoGradGuard no_grad;
                     const auto in = inputs();
                     const auto probs = at::softmax(at::linear(in[0].reshape({-1, H}), in[1]), -1);
                     const auto counts = at::bincount(std::get<1>(at::topk(probs, K, -1)).reshape({-1}), {}, E);
                     for (int64_t e = 0; e < E; ++e) loads.push_back(counts[e].item<int64_t>());
                   }
                   Replay r(mixed);
                   auto x = r.leaf(B * T * H, 4);
                   auto router = r.param(E, H, 4);
                   std::vector<sim::Param> weights;
                   weights.reserve(3 * E);
                   for (int64_t e = 0; e < E; ++e) {
                     weights.push_back(r.param(FE, H, 4));
                     weights.push_back(r.param(FE, H, 4));
                     weights.push_back(r.param(H, FE, 4));
                   }
                   std::vector<sim::Ops::ExpertWeights> experts;
                   for (int64_t e = 0; e < E; ++e) {
                     experts.push_back({&weights[3 * e], &weights[3 * e + 1], &weights[3 * e + 2]});
                   }
                   return r.measure([&] {
                     return r.mixture_of_experts(x, router, experts, K, true, loads, false, false, r.label());
                   });
                 }});
  }
  // Attention, as CausalLM::attention calls it: projections viewed as heads, the output merged back.
  struct Attn {
    std::string description;
    AttentionPath path;
    double dropout;
    int64_t kv_heads;
    std::optional<int64_t> window;
    bool contiguous_query;
  };
  for (const Attn& at :
       std::vector<Attn>{{"fused", AttentionPath::flash, 0, HEADS, std::nullopt, false},
                         {"fused, grouped-query", AttentionPath::flash, 0, 2, std::nullopt, false},
                         {"fused, sliding window 8", AttentionPath::flash, 0, HEADS, 8, false},
                         {"fused, contiguous query", AttentionPath::flash, 0, HEADS, std::nullopt, true},
                         {"math fallback (dropout)", AttentionPath::flash, 0.1, HEADS, std::nullopt, false},
                         {"explicit", AttentionPath::math, 0, HEADS, std::nullopt, false},
                         {"explicit, grouped-query", AttentionPath::math, 0, 2, std::nullopt, false},
                         {"explicit, window and dropout", AttentionPath::math, 0.1, HEADS, 8, false}}) {
    const std::string op = at.path == AttentionPath::math ? "explicit_attention"
                           : at.dropout > 0               ? "math_fallback_attention"
                                                          : "fused_attention";
    c.push_back({op, at.description,
                 [at] {
                   return measure_real(
                       [&] {
                         return std::vector<at::Tensor>{
                             at.contiguous_query ? leaf({B, HEADS, T, HD}) : leaf({B, T, HEADS * HD}),
                             leaf({B, T, at.kv_heads * HD}), leaf({B, T, at.kv_heads * HD})};
                       },
                       [&](const auto& in) {
                         const at::Tensor q = at.contiguous_query ? in[0] : heads_of(in[0], HEADS);
                         return merged(causal_attention(q, heads_of(in[1], at.kv_heads), heads_of(in[2], at.kv_heads),
                                                        at.path, at.dropout, at.window));
                       });
                 },
                 [at, op] {
                   Replay r(false);
                   auto q = r.leaf(B * T * HEADS * HD, 4);
                   auto k = r.leaf(B * T * at.kv_heads * HD, 4), v = r.leaf(B * T * at.kv_heads * HD, 4);
                   const sim::AttentionShape s{B, T, HEADS, at.kv_heads, HD};
                   const bool windowed = at.window.has_value();
                   return r.measure([&] {
                     if (op == "explicit_attention") return r.explicit_attention(q, k, v, s, windowed, at.dropout);
                     if (op == "math_fallback_attention") return r.math_fallback_attention(q, k, v, s, at.dropout);
                     return r.fused_attention(q, k, v, s, windowed, at.contiguous_query);
                   });
                 }});
  }
  return c;
}

}  // namespace headroom::operator_table
