// run_fields(): every setting of a run, one row each (config/run_config.h says what a row holds
// and how a new setting joins): its flag, help text, how its text is read into a RunConfig and
// written back. The table is data; run_config.cpp holds what is done with it (command lines, TOML
// files, validation).
#include "config/run_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <type_traits>

#include "memory/allocator_config.h"
#include "util/error.h"
#include "util/files.h"
#include "util/size.h"


namespace headroom {
namespace {

int64_t parse_int(const std::string& key, const std::string& text) {
  int64_t v = 0;
  const auto* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || ptr != end) fail("--{}: '{}' is not an integer", key, text);
  return v;
}

double parse_number(const std::string& key, const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size() && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  fail("--{}: '{}' is not a number", key, text);
}

bool parse_bool(const std::string& key, const std::string& text) {
  if (text == "true" || text == "1") return true;
  if (text == "false" || text == "0") return false;
  fail("--{}: '{}' is not true or false", key, text);
}

using Kind = RunField::Kind;

std::optional<int64_t> parse_budget(const std::string& text) {
  const int64_t b = parse_size(text, "--memory-budget");
  if (b <= 0) fail("--memory-budget must be positive, got {}", text);
  return b;
}

LeakInjection parse_leak_injection(const std::string& text) {
  for (LeakInjection l : {LeakInjection::keep_graph, LeakInjection::keep_outputs}) {
    if (text == leak_injection_name(l)) return l;
  }
  fail("--inject-leak '{}': accepted: keep-graph, keep-outputs", text);
}

using Texts = std::vector<std::string>;

RunField integer(std::string key, std::string help, int64_t RunConfig::*member) {
  return {key, Kind::integer, std::move(help),
          [key, member](RunConfig& c, const std::string& s) { c.*member = parse_int(key, s); },
          [member](const RunConfig& c) { return Texts{std::to_string(c.*member)}; }};
}
RunField number(std::string key, std::string help, double RunConfig::*member) {
  return {key, Kind::number, std::move(help),
          [key, member](RunConfig& c, const std::string& s) { c.*member = parse_number(key, s); },
          // {} is the shortest text that reads back to the same double
          [member](const RunConfig& c) { return Texts{fmt::format("{}", c.*member)}; }};
}
RunField text(std::string key, std::string help, std::string RunConfig::*member) {
  return {key, Kind::text, std::move(help), [member](RunConfig& c, const std::string& s) { c.*member = s; },
          [member](const RunConfig& c) { return Texts{c.*member}; }};
}
// A setting with named values, parsed once into its type and written back by its name.
template <typename T, typename Name>
RunField choice(std::string key, std::string help, std::type_identity_t<T RunConfig::*> member,
                T (*parse)(const std::string&), Name name) {
  return {key, Kind::text, std::move(help),
          [member, parse](RunConfig& c, const std::string& s) { c.*member = parse(s); },
          [member, name](const RunConfig& c) { return Texts{std::string(name(c.*member))}; }};
}
RunField flag(std::string key, std::string help, bool RunConfig::*member) {
  return {key, Kind::flag, std::move(help),
          [key, member](RunConfig& c, const std::string& s) { c.*member = parse_bool(key, s); },
          [member](const RunConfig& c) { return Texts{c.*member ? "true" : "false"}; }};
}

AllocatorKind parse_allocator_kind(const std::string& s) {
  if (s == "counting") return AllocatorKind::counting;
  if (s == "caching") return AllocatorKind::caching;
  fail("--allocator '{}': accepted: counting or caching", s);
}

}  // namespace

const std::vector<RunField>& run_fields() {
  static const std::vector<RunField> fields = {
      text("model",
           "model: a preset (tiny, small, gpt2, llama-3.2-1b, ...), a config.json path, or a directory holding one "
           "(default: --weights' config.json, else tiny)",
           &RunConfig::model),
      {"set", Kind::list, "override a model config field, key=value (repeatable)",
       [](RunConfig& c, const std::string& s) { c.overrides.push_back(s); },
       [](const RunConfig& c) { return c.overrides; }},
      text("data", "training text file, up to 1 GiB (default: the bundled corpus); byte-level tokens",
           &RunConfig::data),
      text("data-tokens",
           "pre-tokenised training ids instead of --data: an llm.c .bin (256 int32 header: 20240520, version 1 "
           "uint16 / 2 uint32, count, vocabulary size or 0), or uint16:FILE / uint32:FILE for a headerless one "
           "(nanoGPT's); tools/tokenize_corpus.py writes one with the model's tokenizer",
           &RunConfig::data_tokens),
      {"weights", Kind::text,
       "start from this Hugging Face checkpoint directory (model.safetensors, or its index and shards); --model "
       "defaults to its config.json",
       [](RunConfig& c, const std::string& s) {
         c.weights = s;
         if (c.model == RunConfig{}.model) c.model = s;  // its own config, unless --model names another
       },
       [](const RunConfig& c) { return Texts{c.weights}; }},
      text("save-weights",
           "at the end, write the trained weights as a Hugging Face checkpoint into this directory (config.json + "
           "model.safetensors, which transformers' from_pretrained loads)",
           &RunConfig::save_weights),
      flag("merge-lora",
           "--save-weights with --finetune lora: write the adapters merged into the weights (a full checkpoint) "
           "instead of a peft adapter directory (adapter_config.json + adapter_model.safetensors)",
           &RunConfig::merge_lora),
      text("adapter",
           "with --finetune lora: start the adapters from this peft LoRA adapter directory (its r and alpha must be "
           "--finetune's)",
           &RunConfig::adapter),
      integer("steps", "optimizer steps to train (total, counting resumed ones)", &RunConfig::steps),
      integer("batch", "micro-batch size in sequences", &RunConfig::batch),
      integer("accum", "micro-batches accumulated per optimizer step", &RunConfig::accum),
      integer("seq", "sequence length in tokens", &RunConfig::seq),
      number("lr", "peak learning rate", &RunConfig::lr),
      number("min-lr-ratio", "cosine schedule ends at lr * this", &RunConfig::min_lr_ratio),
      integer("warmup", "linear warm-up steps (default: 5% of --steps)", &RunConfig::warmup),
      choice("optimizer", "sgd, momentum, adam, adamw, adagrad, adafactor or adamw8bit (AdamW with 8-bit moments, cpu)", &RunConfig::optimizer, &parse_optimizer,
             &optimizer_name),
      choice("optimizer-impl",
             "estimate, plan: whose optimizer update to predict: headroom (its trainer's, in place) or torch "
             "(torch.optim's default, as a Python script runs it: a new tensor for the denominator of each "
             "parameter on cpu, of all parameters at once on cuda)",
             &RunConfig::optimizer_impl, &parse_optimizer_impl, &optimizer_impl_name),
      number("weight-decay",
             "weight decay on matrices, as PyTorch's optimizer of that name applies it (default: 0.1 for "
             "adamw, 0 for the others)",
             &RunConfig::weight_decay),
      number("grad-clip", "clip the global gradient norm to this (0: off)", &RunConfig::grad_clip),
      {"seed", Kind::integer, "seed for initialisation, data order and dropout",
       [](RunConfig& c, const std::string& s) {
         const int64_t v = parse_int("seed", s);
         if (v < 0) fail("--seed must be non-negative, got {}", v);
         c.seed = static_cast<uint64_t>(v);
       },
       [](const RunConfig& c) { return Texts{std::to_string(c.seed)}; }},
      text("device", "auto (cuda when present), cpu, cuda or cuda:N", &RunConfig::device),
      integer("threads",
              "cpu intra-op threads (default: OMP_NUM_THREADS, else the cores not busy with other work, from the "
              "load average; pin it for bit-identical runs across machines and loads)",
              &RunConfig::threads),
      choice("attention", "flash (fused SDPA) or math (explicit softmax, materialises scores)", &RunConfig::attention,
             &parse_attention_path, &attention_path_name),
      choice("precision",
             "fp32, bf16-mixed, fp16-mixed (autocast with dynamic loss scaling), bf16 (pure), or bf16-params "
             "(FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), torchtitan's default: "
             "float32 weights, gradients and optimizer state, each layer cast to bf16 and gathered to compute in "
             "bf16, its gradients reduced in float32; with --shard full, or on one process)",
             &RunConfig::precision, &parse_precision, &precision_name),
      choice("checkpointing",
             "activation checkpointing: none, selective (attention), full (every layer), every:K, or ops (per-op, "
             "torchtitan's default: in each layer the output of every second matmul and of attention kept, the rest "
             "recomputed in backward)",
             &RunConfig::checkpointing, &parse_checkpoint_policy,
             [](const CheckpointPolicy& k) { return k.name(); }),
      choice("finetune",
             "which parameters train: full (default), freeze:PATTERN[,PATTERN] (globs over headroom's or Hugging "
             "Face's parameter names; those matching are frozen), or lora:r=R[,alpha=A][,dropout=P][,targets=q,k,v,o,"
             "gate,up,down] (the base frozen, low-rank adapters trained, as peft's LoraConfig; defaults alpha 8, "
             "dropout 0, targets q,v)",
             &RunConfig::finetune, &parse_finetune, [](const Finetune& f) { return f.name(); }),
      choice("base-weights",
             "with --finetune lora: the frozen base's projections dense (default) or nf4 (QLoRA: 4-bit NormalFloat in "
             "blocks of 64 with a float32 absmax each, dequantised a layer at a time in forward and again in "
             "backward); embeddings, norms and the head stay dense",
             &RunConfig::base_weights, &parse_base_weights, &base_weights_name),
      choice("offload",
             "none (default), optimizer, activations or optimizer,activations. optimizer: the optimizer's state and "
             "its update in host memory (torchao's CPUOffloadOptimizer): each step copies the gradients to the host, "
             "updates there and copies the parameters back. activations: what each layer saves for backward goes to "
             "host memory as it is saved and comes back when backward needs it (with checkpointing: only the "
             "layers' inputs). On cpu the host pool is counted apart from the --memory-budget device",
             &RunConfig::offload, &parse_offload, &offload_name),
      choice("loss",
             "full (default: the whole [tokens x vocab] logits, in float32 for the loss) or chunked[:TOKENS] (the "
             "LM head and the cross-entropy a chunk of tokens at a time, Liger's and Cut Cross-Entropy's lever; "
             "backward recomputes each chunk's logits; TOKENS defaults to tokens / ceil(vocab / hidden), to a power "
             "of two, at least 256)",
             &RunConfig::loss, &parse_loss, [](const LossSetting& l) { return l.name(); }),
      choice("moe-routing",
             "estimate, plan, fit, doctor on a mixture of experts: the routing to assume: balanced (default), worst "
             "(top_k experts take every token) or the hottest expert's load relative to the balanced share, as "
             "`headroom train` measures it (e.g. 1.8)",
             &RunConfig::routing, &parse_moe_routing, [](const MoeRouting& r) { return r.name(); }),
      {"memory-budget", Kind::text,
       "device memory to allow, e.g. 512MiB, 24GiB: on cpu a simulated device of that size, on cuda a cap "
       "below the card",
       [](RunConfig& c, const std::string& s) { c.memory_budget = parse_budget(s); },
       [](const RunConfig& c) { return c.memory_budget ? Texts{format_size(*c.memory_budget)} : Texts{}; }},
      choice("allocator",
             "cpu memory: counting (default; the budget caps live bytes) or caching (PyTorch's CUDA caching allocator "
             "reproduced: reserved memory, fragmentation, empty_cache; the budget caps reserved bytes, as a card "
             "does). cuda always uses PyTorch's",
             &RunConfig::allocator, &parse_allocator_kind, &allocator_kind_name),
      {"allocator-conf", Kind::text,
       "caching allocator settings in PYTORCH_CUDA_ALLOC_CONF's syntax, e.g. expandable_segments:True or "
       "max_split_size_mb:128,garbage_collection_threshold:0.8 (default: the environment's PYTORCH_ALLOC_CONF or "
       "PYTORCH_CUDA_ALLOC_CONF)",
       [](RunConfig& c, const std::string& s) {
         parse_allocator_config(s, "--allocator-conf");  // refused here, with the option named
         c.allocator_conf = s;
       },
       [](const RunConfig& c) { return Texts{c.allocator_conf}; }},
      text("memory-snapshot",
           "write the allocator's memory snapshot (open in pytorch.org/memory_viz) to FILE: cuda, or cpu with "
           "--allocator caching",
           &RunConfig::memory_snapshot),
      {"inject-oom", Kind::text,
       "cpu testing aid: fail an allocation as if out of memory, STEP:N (the N-th of step STEP) or "
       "STEP:above:SIZE (its first allocation larger than SIZE); @RANK: on that rank only (torchrun)",
       [](RunConfig& c, const std::string& s) { c.inject_oom = parse_oom_injection(s); },
       [](const RunConfig& c) { return c.inject_oom ? Texts{c.inject_oom->text()} : Texts{}; }},
      choice("inject-leak",
             "plant a leak, for the leak detector: keep-graph (losses summed without detaching, backward told to "
             "retain the graph) or keep-outputs (each step's logits kept)",
             &RunConfig::inject_leak, &parse_leak_injection, &leak_injection_name),
      text("metrics", "write one JSON object per optimizer step to this JSONL file", &RunConfig::metrics),
      text("checkpoint", "save checkpoints (atomically) into this directory", &RunConfig::checkpoint),
      integer("checkpoint-every", "also checkpoint every N steps (0: only at the end)", &RunConfig::checkpoint_every),
      integer("stop-at",
              "stop after this step, checkpointing first, keeping the --steps schedule "
              "(for time-sliced jobs; continue with --resume)",
              &RunConfig::stop_at),
      text("resume", "continue from the checkpoint in this directory", &RunConfig::resume),
      integer("eval-every", "evaluate held-out loss every N steps (0: only at the end)", &RunConfig::eval_every),
      integer("eval-rows", "held-out sequences per evaluation (0: no evaluation)", &RunConfig::eval_rows),
      {"plan", Kind::text,
       "auto: before training, choose the fastest plan that fits the memory budget (micro-batch x "
       "accumulation at the same --batch x --accum sequences per step, precision, checkpointing, attention), "
       "as `headroom plan` ranks them",
       [](RunConfig& c, const std::string& s) {
         if (s != "auto") fail("--plan '{}': accepted: auto", s);
         c.plan_auto = true;
       },
       [](const RunConfig& c) { return c.plan_auto ? Texts{"auto"} : Texts{}; }},
      flag("no-guard",
           "turn the OOM guard off: by default an OOM in a step re-runs it with half the micro-batch and "
           "twice the accumulation (same data), down to micro-batch 1",
           &RunConfig::no_guard),
      choice("shard",
             "under torchrun: none (data parallel), optimizer (ZeRO-1: optimizer state split over the ranks), "
             "gradients (ZeRO-2: gradients too) or full (ZeRO-3: weights too, gathered a layer at a time); --batch "
             "is per rank, the global batch is batch x accum x ranks",
             &RunConfig::shard, &parse_shard_level, &shard_level_name),
      {"pipeline", Kind::integer,
       "under torchrun: cut the layers into P pipeline stages trained with a 1F1B schedule (--accum micro-batches "
       "a step; the embeddings on the first stage, the head and loss on the last); the ranks are P x D, each stage "
       "trained by D data-parallel ranks (any --shard level among them), or P x D x T with "
       "--tensor-parallel T; 1: no pipeline",
       [](RunConfig& c, const std::string& s) { c.pipeline.stages = parse_int("pipeline", s); },
       [](const RunConfig& c) { return Texts{std::to_string(c.pipeline.stages)}; }},
      {"pipeline-split", Kind::text,
       "with --pipeline: each stage's layers, as FIRST:END ranges (0:12,12:24); default: the cut whose highest "
       "stage peaks lowest by the estimator (stage 0 keeps the most micro-batches in flight, the last the head "
       "and loss), which estimate prints",
       [](RunConfig& c, const std::string& s) { c.pipeline.split = s.empty() ? std::vector<LayerRange>{} : parse_pipeline_split(s); },
       [](const RunConfig& c) { return Texts{pipeline_split_text(c.pipeline.split)}; }},
      integer("tensor-parallel",
              "under torchrun: split each layer's attention heads and MLP inner dimension, and the vocabulary (the "
              "embedding, the head and the loss), over T ranks, neighbours on a node; the ranks are D x T (P x D x "
              "T with --pipeline P), D data-parallel ranks of T (any --shard level among them); "
              "key/value heads fewer than T are replicated; 1: none",
              &RunConfig::tensor_parallel),
      flag("reshard-after-forward",
           "with --shard full or --precision bf16-params: a layer's gathered weights are let go after its forward "
           "and gathered again for its backward (true, FSDP2's default), or kept until backward has its "
           "gradients (false: less communication, more memory)",
           &RunConfig::reshard_after_forward),
      flag("sequence-parallel",
           "with --tensor-parallel: the norms, residual stream and dropouts between the projections hold 1/T of "
           "the tokens on each rank (all-gathered before the column-parallel projections and the head, "
           "reduce-scattered after the row-parallel ones, as torch's SequenceParallel and Megatron-LM do); on by "
           "default, --sequence-parallel=false replicates them; --seq must be a multiple of T",
           &RunConfig::sequence_parallel),
      integer("world-size",
              "ranks to predict and plan for (estimate, plan; default: WORLD_SIZE under torchrun, else 1): pipeline "
              "stages x tensor-parallel ranks x data-parallel ranks; under torchrun it must equal the ranks launched",
              &RunConfig::world_size),
      integer("dist-timeout",
              "under torchrun: seconds a rank waits for the others (rendezvous, each collective) before it stops "
              "with an error",
              &RunConfig::dist_timeout),
      flag("json", "print one JSON summary object on stdout at the end", &RunConfig::json),
      flag("quiet", "no progress lines on stderr", &RunConfig::quiet),
  };
  return fields;
}

const RunField* find_run_field(const std::string& key) {
  for (const RunField& f : run_fields()) {
    if (f.key == key) return &f;
  }
  return nullptr;
}

const char* leak_injection_name(LeakInjection leak) {
  switch (leak) {
    case LeakInjection::none: return "none";
    case LeakInjection::keep_graph: return "keep-graph";
    case LeakInjection::keep_outputs: return "keep-outputs";
  }
  return "?";
}

std::string OomInjection::text() const {
  if (!given.empty()) return given;
  return nth > 0 ? fmt::format("{}:{}", step, nth) : fmt::format("{}:above:{}", step, above_bytes);
}

OomInjection parse_oom_injection(const std::string& given) {
  auto bad = [&]() -> OomInjection {
    fail(
        "--inject-oom '{}': expected STEP:N (fail the N-th allocation of step STEP) or STEP:above:SIZE, e.g. "
        "2:150 or 3:above:1MiB, optionally @RANK for one rank of a data-parallel run (2:150@1)",
        given);
  };
  std::string text = given;
  OomInjection o;
  if (const auto at = text.find('@'); at != std::string::npos) {
    try {
      const int64_t r = parse_int("inject-oom", text.substr(at + 1));
      if (r < 0 || r > (1 << 20)) return bad();
      o.rank = static_cast<int>(r);
    } catch (const Error&) {
      return bad();
    }
    text = text.substr(0, at);
  }
  const auto colon = text.find(':');
  if (colon == std::string::npos) return bad();
  try {
    o.step = parse_int("inject-oom", text.substr(0, colon));
    const std::string what = text.substr(colon + 1);
    if (what.rfind("above:", 0) == 0) {
      o.above_bytes = parse_size(what.substr(6), "--inject-oom");
    } else {
      o.nth = parse_int("inject-oom", what);
      if (o.nth <= 0) return bad();
    }
  } catch (const Error&) {
    return bad();
  }
  if (o.step <= 0) return bad();
  o.given = given;
  return o;
}

}  // namespace headroom
