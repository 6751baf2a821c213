// The estimator's accuracy grid, shared by its test and its benchmark: one real model of each
// family at its published width and vocabulary, shrunk in depth only, tied and untied heads, every
// precision, optimizer, checkpointing policy and attention path, several micro-batches, sequence
// lengths and accumulations. (A grid that shrank width and vocabulary once hid a tied-embedding bug
// worth a whole embedding matrix.)
#pragma once

#include <fmt/format.h>

#include <ostream>
#include <string>
#include <vector>

#include "config/run_config.h"

namespace headroom::testing {

struct GridFamily {
  std::string label;   // the family, for test names
  std::string preset;  // a real model of it
  std::vector<std::string> overrides;
};

// gpt2 (tied, learned positions, dropout), pythia-160m (gpt_neox: untied, parallel residual,
// partial rotary), smollm-135m (llama: tied, grouped-query attention), qwen2.5-0.5b (tied, qkv
// biases) and mistral-7b (untied, sliding window, here 16 so that the windowed mask is exercised);
// qwen3-0.6b (tied, q/k norms per head), qwen3-30b-a3b with 8 of its experts and a dense layer, and
// with all 128 experts in one layer, mixtral-8x7b with 2 of its experts (a window of 16), gemma-3-1b
// (tied, 262,144 tokens, sandwich norms, a sliding and a global layer with their two rotary bases),
// phi-3-mini (fused qkv and gate_up, a window of 16), olmo-2-7b (post-norms, whole-projection
// q/k norms) and smollm3-3b (tied; its second layer without rotary, as every fourth is).
// gtest prints parameters byte by byte unless told how.
inline void PrintTo(const GridFamily& f, std::ostream* os) { *os << f.label; }

inline std::vector<GridFamily> grid_families() {
  return {{"gpt2", "gpt2", {"n_layer=2"}},
          {"gpt_neox", "pythia-160m", {"num_hidden_layers=2"}},
          {"llama", "smollm-135m", {"num_hidden_layers=2"}},
          {"qwen2", "qwen2.5-0.5b", {"num_hidden_layers=1"}},
          {"mistral", "mistral-7b", {"num_hidden_layers=1", "sliding_window=16"}},
          {"qwen3", "qwen3-0.6b", {"num_hidden_layers=2"}},
          {"qwen3_moe", "qwen3-30b-a3b", {"num_hidden_layers=2", "num_experts=8", "mlp_only_layers=[1]"}},
          {"qwen3_moe_128_experts", "qwen3-30b-a3b", {"num_hidden_layers=1"}},
          {"mixtral", "mixtral-8x7b", {"num_hidden_layers=1", "num_local_experts=2", "sliding_window=16"}},
          {"gemma3", "gemma-3-1b", {"num_hidden_layers=2", "sliding_window=16", "sliding_window_pattern=2"}},
          {"phi3", "phi-3-mini", {"num_hidden_layers=1", "sliding_window=16"}},
          {"olmo2", "olmo-2-7b", {"num_hidden_layers=1"}},
          {"smollm3", "smollm3-3b", {"num_hidden_layers=2", "no_rope_layers=[1,0]"}}};
}

// One configuration of a family's accuracy grid.
struct GridVariant {
  int64_t batch, seq, accum;
  const char *precision, *attention, *optimizer, *checkpointing;
  const char* finetune = "full";
  const char* offload = "none";
  const char* base_weights = "dense";
  const char* loss = "full";
};

// The grid's variants of one family: eight by default; per family those its size allows.
inline std::vector<GridVariant> grid_variants(const GridFamily& family) {
  std::vector<GridVariant> variants = {
      {4, 32, 1, "fp32", "flash", "adamw", "none"},           {2, 64, 1, "fp32", "math", "sgd", "none"},
      {2, 32, 1, "bf16-mixed", "flash", "adam", "selective"}, {2, 32, 1, "fp16-mixed", "math", "momentum", "full"},
      {2, 32, 1, "bf16", "flash", "adafactor", "every:2"},    {8, 16, 2, "fp32", "flash", "adagrad", "none"},
      {1, 64, 1, "fp32", "flash", "adamw", "full"},           {3, 32, 2, "bf16-mixed", "math", "adamw", "none"},
  };
  if (family.preset == "qwen2.5-0.5b") {
    variants = {{2, 32, 1, "fp32", "flash", "adamw", "none"},
                {2, 32, 1, "bf16-mixed", "math", "sgd", "selective"},
                {1, 16, 1, "fp16-mixed", "flash", "adafactor", "full"},
                {2, 16, 2, "bf16", "flash", "adamw", "none"}};
  } else if (family.preset == "mistral-7b") {
    // Three, at 480M parameters a layer: fp16-mixed runs autocast as bf16-mixed does (the other
    // families cover its loss scaling).
    variants = {{2, 32, 1, "fp32", "math", "sgd", "none"},
                {1, 16, 1, "bf16-mixed", "flash", "adafactor", "selective"},
                {2, 32, 1, "bf16", "flash", "adafactor", "none"}};
  }
  if (family.label == "qwen3") {
    variants = {{2, 32, 1, "fp32", "flash", "adamw", "none"},
                {2, 32, 1, "bf16-mixed", "math", "sgd", "selective"},
                {1, 64, 1, "bf16", "flash", "adafactor", "full"},
                {2, 32, 1, "bf16-mixed", "flash", "adamw", "none", "lora:r=8,dropout=0.05,targets=q,k,v,o,gate,up,down"},
                {2, 32, 1, "fp32", "flash", "adamw", "selective", "freeze:embed_tokens.weight,layers.0.*"},
                {2, 32, 1, "bf16", "flash", "adamw", "full", "lora:r=16"},
                {2, 32, 1, "bf16", "flash", "adamw8bit", "selective", "freeze:embed_tokens.weight"},
                {2, 32, 1, "bf16", "flash", "adamw8bit", "none", "lora:r=8,targets=q,k,v,o", "optimizer"},
                {2, 32, 1, "bf16", "flash", "adamw", "none", "lora:r=8,targets=q,k,v,o,gate,up,down", "none", "nf4"},
                {1, 16, 1, "bf16-mixed", "flash", "adamw", "none", "full", "none", "dense", "chunked:6"},
                {2, 32, 1, "fp32", "flash", "sgd", "none", "full", "activations"},
                {2, 32, 1, "fp32", "flash", "sgd", "full", "full", "activations", "dense", "chunked"},
                {2, 32, 1, "bf16-mixed", "flash", "adamw", "ops"}};
  } else if (family.label == "qwen3_moe") {
    // At most 6 GB each (fp32 weights with AdamW would hold 11.8 GB: two tests run side by side).
    variants = {{4, 32, 1, "bf16", "flash", "adamw", "none"},
                {2, 32, 1, "bf16-mixed", "flash", "sgd", "none"},
                {2, 32, 2, "bf16", "math", "sgd", "full"},
                {2, 32, 1, "bf16", "flash", "adamw", "none", "lora:r=8,targets=q,k,v,o"}};
  } else if (family.label == "qwen3_moe_128_experts") {
    variants = {{2, 32, 1, "bf16", "flash", "sgd", "none"}, {1, 32, 1, "bf16-mixed", "flash", "sgd", "none"}};
  } else if (family.label == "mixtral") {
    variants = {{2, 32, 1, "bf16", "flash", "sgd", "none"}, {1, 32, 1, "bf16-mixed", "math", "adafactor", "selective"}};
  } else if (family.label == "gemma3") {
    variants = {{2, 32, 1, "fp32", "flash", "adamw", "none"},
                {2, 32, 1, "bf16-mixed", "math", "sgd", "none"},
                {1, 32, 1, "bf16", "flash", "adafactor", "selective"},
                {2, 32, 1, "bf16-mixed", "flash", "adamw", "none", "lora:r=16,alpha=32,targets=q,v,o"},
                {2, 32, 1, "fp32", "flash", "sgd", "none", "full", "none", "dense", "chunked"},
                {2, 32, 1, "bf16", "flash", "sgd", "ops"}};
  } else if (family.label == "phi3") {
    variants = {{2, 32, 1, "fp32", "flash", "sgd", "none"},
                {2, 32, 1, "bf16-mixed", "flash", "adafactor", "full"},
                {2, 32, 1, "bf16-mixed", "flash", "adamw", "none", "lora:r=8,targets=q,k,v,o,gate,up,down"},
                {2, 32, 1, "bf16", "flash", "sgd", "ops"}};
  } else if (family.label == "olmo2") {
    variants = {{2, 32, 1, "bf16", "flash", "adafactor", "none"},
                {1, 32, 1, "bf16-mixed", "math", "sgd", "none"},
                {2, 32, 1, "bf16", "flash", "sgd", "none"}};
  } else if (family.label == "smollm3") {  // 2 layers: the 2nd without rotary
    variants = {{2, 32, 1, "bf16", "flash", "sgd", "none"}, {1, 32, 1, "bf16-mixed", "flash", "sgd", "selective"},
                {2, 32, 1, "bf16", "flash", "sgd", "ops"}};
  }
  // Fine-tuning: gpt2's fused, transposed projections under LoRA; a tied llama with frozen
  // embeddings and its first layer.
  if (family.preset == "gpt2") {
    variants.push_back({2, 32, 1, "fp32", "flash", "adamw", "none", "lora:r=16,targets=q,o,up,down"});
    variants.push_back({2, 32, 1, "bf16-mixed", "flash", "adamw8bit", "none"});
    variants.push_back({2, 32, 1, "fp32", "flash", "adamw", "selective", "full", "optimizer"});
    variants.push_back({2, 32, 1, "bf16-mixed", "flash", "adamw", "none", "lora:r=16,targets=q,o,up,down", "none", "nf4"});
  }
  if (family.preset == "pythia-160m") {  // untied: the head a weight of its own
    variants.push_back({2, 32, 1, "fp32", "flash", "adamw", "none", "full", "activations", "dense", "chunked:40"});
    variants.push_back({2, 32, 1, "bf16-mixed", "flash", "adam", "ops"});  // fused q/k/v with biases: not kept
  }
  if (family.preset == "smollm-135m") {
    variants.push_back({2, 32, 1, "bf16-mixed", "flash", "adamw", "none", "freeze:embed_tokens.weight,layers.0.*"});
    variants.push_back({2, 32, 2, "fp32", "flash", "adamw", "ops"});
  }
  return variants;
}

// The configurations of one family. The three small models get eight, the larger two four and three,
// with lighter optimizers and fewer tokens where their size would make the test slow or heavy
// (mistral's single layer has 480M parameters).
inline std::vector<RunConfig> accuracy_grid(const GridFamily& family) {
  std::vector<RunConfig> grid;
  for (const GridVariant& v : grid_variants(family)) {
    RunConfig cfg;
    cfg.model = family.preset;
    cfg.overrides = family.overrides;
    cfg.batch = v.batch;
    cfg.seq = v.seq;
    cfg.accum = v.accum;
    cfg.precision = parse_precision(v.precision);
    cfg.attention = parse_attention_path(v.attention);
    cfg.optimizer = parse_optimizer(v.optimizer);
    cfg.checkpointing = parse_checkpoint_policy(v.checkpointing);
    cfg.finetune = parse_finetune(v.finetune);
    cfg.offload = parse_offload(v.offload);
    cfg.base_weights = parse_base_weights(v.base_weights);
    cfg.loss = parse_loss(v.loss);
    cfg.device = "cpu";
    grid.push_back(cfg);
  }
  return grid;
}

// The test's share of a family's grid (estimator_test.cpp; the whole grid runs in
// bench_estimate_accuracy and bench_reserved_accuracy): chosen so that, over the five families,
// the tied heads at real vocabularies (gpt2, smollm, qwen2.5: the bug a shrunk grid once hid) meet
// every precision — bf16-mixed, fp16-mixed with its scaler, pure bf16 — and together the subset
// covers every optimizer, checkpointing policy, attention path and an accumulation of 2.
inline std::vector<RunConfig> accuracy_subset(const GridFamily& family) {
  std::vector<size_t> keep;
  if (family.preset == "gpt2") keep = {0, 3, 4, 8, 9, 10, 11};  // fp32 adamw; fp16-mixed momentum full; bf16 adafactor; LoRA; 8-bit; offload; nf4
  if (family.preset == "pythia-160m") keep = {1, 5, 7, 8};  // math sgd; adagrad accum 2; bf16-mixed math accum 2; offloaded activations with a chunked untied head
  // bf16-mixed adam selective; adamw full; frozen tied embedding; per-op checkpointing, accum 2
  if (family.preset == "smollm-135m") keep = {2, 6, 8, 9};
  if (family.preset == "qwen2.5-0.5b") keep = {1, 2};    // bf16-mixed math sgd selective; fp16-mixed adafactor full
  if (family.preset == "mistral-7b") keep = {0};         // math sgd at seq 32: the window of 16 masks
  // fp32 adamw; bf16-mixed math selective; LoRA; frozen; 8-bit; offload; nf4; chunked loss; offloaded
  // activations; both over full checkpointing; per-op checkpointing under autocast
  if (family.label == "qwen3") keep = {0, 1, 3, 4, 6, 7, 8, 9, 10, 11, 12};
  if (family.label == "qwen3_moe") keep = {1, 2, 3};     // bf16-mixed (fp32 weights); bf16 math full, accum 2; LoRA
  if (family.label == "qwen3_moe_128_experts") keep = {0};  // all 128 experts, bf16
  if (family.label == "mixtral") keep = {0};             // bf16 sgd, windowed
  // fp32 adamw; bf16-mixed math; LoRA; chunked loss at 262,144 tokens; per-op checkpointing, a windowed
  // layer's attention not kept
  if (family.label == "gemma3") keep = {0, 1, 3, 4, 5};
  if (family.label == "phi3") keep = {1, 2};             // bf16-mixed full checkpointing, windowed; LoRA fused
  // bf16 sgd: Adafactor's statistics over the untied 100,352 x 4,096 embedding and head took two
  // thirds of the family's time (42.6 s against 15.7 s for one train); gpt2 and qwen2.5 keep Adafactor
  if (family.label == "olmo2") keep = {2};
  if (family.label == "smollm3") keep = {0};             // bf16 sgd, a layer without rotary
  const std::vector<RunConfig> grid = accuracy_grid(family);
  std::vector<RunConfig> out;
  for (size_t i : keep) out.push_back(grid.at(i));
  return out;
}

inline std::vector<RunConfig> accuracy_grid() {
  std::vector<RunConfig> all;
  for (const auto& f : grid_families()) {
    for (auto& c : accuracy_grid(f)) all.push_back(std::move(c));
  }
  return all;
}

inline std::string describe(const RunConfig& c) {
  return fmt::format("{} b{} s{} a{} {} {} {} {}{}{}{}{}", c.model, c.batch, c.seq, c.accum, precision_name(c.precision),
                     attention_path_name(c.attention), optimizer_name(c.optimizer), c.checkpointing.name(),
                     c.finetune.full() ? "" : " " + c.finetune.name(),
                     c.offload == Offload::none ? "" : fmt::format(" offload {}", offload_name(c.offload)),
                     c.base_weights == BaseWeights::dense ? "" : fmt::format(" base {}", base_weights_name(c.base_weights)),
                     c.loss.chunked ? " loss " + c.loss.name() : "");
}

}  // namespace headroom::testing
