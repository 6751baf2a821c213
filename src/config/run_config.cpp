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

using Kind = RunField::Kind;
using Texts = std::vector<std::string>;

int64_t RunConfig::warmup_steps() const {
  if (warmup >= 0) return warmup;
  return std::max<int64_t>(1, steps / 20);
}

std::vector<std::string> run_args(const RunConfig& config, const RunConfig& base,
                                  const std::vector<std::string>& always) {
  std::vector<std::string> out;
  for (const RunField& f : run_fields()) {
    const Texts value = f.get(config);
    const bool forced = std::find(always.begin(), always.end(), f.key) != always.end();
    if (value == f.get(base) && !forced) continue;
    const std::string flag = "--" + f.key;
    if (f.kind == Kind::flag) {
      out.push_back(value.front() == "true" ? flag : flag + "=false");
      continue;
    }
    for (const std::string& v : value) out.insert(out.end(), {flag, v});
  }
  return out;
}

std::string shell_line(const std::vector<std::string>& args) {
  std::string out;
  for (const std::string& a : args) {
    if (!out.empty()) out += ' ';
    const bool plain = !a.empty() && std::all_of(a.begin(), a.end(), [](unsigned char ch) {
      return std::isalnum(ch) || std::strchr("-_./:=,+@%", ch) != nullptr;
    });
    if (plain) {
      out += a;
      continue;
    }
    out += '\'';
    for (char ch : a) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    out += '\'';
  }
  return out;
}

std::string run_toml(const RunConfig& config, const RunConfig& base, const std::vector<std::string>& always) {
  auto quoted = [](const std::string& s) {
    std::string out = "\"";
    for (unsigned char ch : s) {
      if (ch == '"' || ch == '\\') {
        out += '\\';
        out += static_cast<char>(ch);
      } else if (ch < 0x20 || ch == 0x7f) {
        out += fmt::format("\\u{:04X}", ch);
      } else {
        out += static_cast<char>(ch);
      }
    }
    return out + "\"";
  };
  std::string out;
  for (const RunField& f : run_fields()) {
    const Texts value = f.get(config);
    const bool forced = std::find(always.begin(), always.end(), f.key) != always.end();
    if (value == f.get(base) && !forced) continue;
    std::string v;
    switch (f.kind) {
      case Kind::list: {
        std::vector<std::string> items;
        for (const std::string& item : value) items.push_back(quoted(item));
        v = fmt::format("[{}]", fmt::join(items, ", "));
        break;
      }
      case Kind::integer:
      case Kind::flag: v = value.front(); break;
      case Kind::number:  // TOML's float: with a point or an exponent, or an integer reads as one
        v = value.front();
        if (v.find_first_of(".eEni") == std::string::npos) v += ".0";
        break;
      case Kind::text:
        if (value.empty()) continue;  // an optional unset where the base has one: not expressible
        v = quoted(value.front());
        break;
    }
    out += fmt::format("{} = {}\n", f.key, v);
  }
  return out;
}

void apply_toml_file(RunConfig& config, const std::string& path) {
  toml::table table;
  const std::string text = read_file(path, "--config", int64_t{16} << 20);
  try {
    table = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    const auto& where = e.source().begin;
    if (where.line == 0) fail("--config: cannot read '{}': {}", path, e.description());
    fail("--config {}:{}:{}: {}", path, where.line, where.column, e.description());
  }
  std::vector<std::string> keys;
  for (const auto& f : run_fields()) keys.push_back(f.key);
  for (const auto& [key, node] : table) {
    const std::string k(key.str());
    const RunField* field = find_run_field(k);
    if (field == nullptr) fail("--config {}: unknown key '{}'; accepted: {}", path, k, fmt::join(keys, ", "));
    auto scalar = [&](const toml::node& n) -> std::string {
      if (auto v = n.value<int64_t>(); v && n.is_integer()) return std::to_string(*v);
      if (auto v = n.value<double>(); v && n.is_floating_point()) return fmt::format("{}", *v);
      if (auto v = n.value<bool>(); v && n.is_boolean()) return *v ? "true" : "false";
      if (auto v = n.value<std::string>(); v && n.is_string()) return *v;
      fail("--config {}: key '{}' has a value of an unsupported type", path, k);
    };
    if (field->kind == RunField::Kind::list) {
      const toml::array* arr = node.as_array();
      if (arr == nullptr) fail("--config {}: key '{}' must be an array of strings", path, k);
      for (const auto& item : *arr) field->set(config, scalar(item));
    } else {
      if (field->kind == RunField::Kind::integer && !node.is_integer()) {
        fail("--config {}: key '{}' must be an integer", path, k);
      }
      if (field->kind == RunField::Kind::flag && !node.is_boolean()) {
        fail("--config {}: key '{}' must be true or false", path, k);
      }
      field->set(config, scalar(node));
    }
  }
}

double RunConfig::weight_decay_value() const {
  if (weight_decay >= 0) return weight_decay;
  return optimizer == OptimizerKind::adamw ? 0.1 : 0.0;
}

const char* allocator_kind_name(AllocatorKind a) { return a == AllocatorKind::caching ? "caching" : "counting"; }

RunConfig as_trial(RunConfig c, int64_t steps) {
  c.steps = steps;
  c.warmup = -1;  // the given warm-up may be longer than a trial
  c.no_guard = true;
  c.eval_rows = 0;
  c.quiet = true;
  c.json = false;
  c.metrics.clear();
  c.checkpoint.clear();
  c.checkpoint_every = 0;
  c.resume.clear();
  c.stop_at = 0;
  c.plan_auto = false;
  c.memory_snapshot.clear();
  c.inject_oom.reset();
  return c;
}

int64_t world_size_of(const RunConfig& c) {
  if (c.world_size > 0) return c.world_size;
  const char* env = std::getenv("WORLD_SIZE");
  if (env == nullptr || *env == '\0') return 1;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  return (end != env && *end == '\0' && v >= 1) ? v : 1;  // a malformed one is the launch's error to give
}

namespace {

// The numeric flags: sizes, rates and limits in their ranges.
void check_numbers(const RunConfig& c) {
  auto positive = [](const char* flag, int64_t v) {
    if (v <= 0) fail("--{} must be positive, got {}", flag, v);
  };
  positive("steps", c.steps);
  positive("batch", c.batch);
  positive("accum", c.accum);
  positive("seq", c.seq);
  if (c.eval_rows < 0) fail("--eval-rows must be non-negative (0 turns evaluation off), got {}", c.eval_rows);
  if (c.batch > (int64_t{1} << 20) || c.seq > (int64_t{1} << 22) || c.accum > (int64_t{1} << 20)) {
    fail("--batch/--seq/--accum out of range (batch and accum at most 2^20, seq at most 2^22)");
  }
  if (!(c.lr > 0)) fail("--lr must be positive, got {}", c.lr);
  if (c.min_lr_ratio < 0 || c.min_lr_ratio > 1) fail("--min-lr-ratio must be in [0, 1], got {}", c.min_lr_ratio);
  if (c.warmup < -1) fail("--warmup must be non-negative, got {}", c.warmup);
  if (c.warmup > c.steps) fail("--warmup {} is longer than --steps {}; accepted: 0 to {}", c.warmup, c.steps, c.steps);
  if (c.weight_decay < 0 && c.weight_decay != -1) fail("--weight-decay must be non-negative, got {}", c.weight_decay);
  if (c.grad_clip < 0) fail("--grad-clip must be non-negative (0 turns clipping off), got {}", c.grad_clip);
  if (c.checkpoint_every < 0) fail("--checkpoint-every must be non-negative, got {}", c.checkpoint_every);
  if (c.eval_every < 0) fail("--eval-every must be non-negative, got {}", c.eval_every);
  if (c.threads < 0 || c.threads > 4096) fail("--threads must be in [0, 4096] (0: automatic), got {}", c.threads);
  if (c.world_size < 0 || c.world_size > 65536) fail("--world-size must be 1 to 65536, got {}", c.world_size);
  if (c.dist_timeout <= 0 || c.dist_timeout > 86400) {
    fail("--dist-timeout must be 1 to 86400 seconds, got {}", c.dist_timeout);
  }
  if (c.memory_budget && *c.memory_budget <= 0) fail("--memory-budget must be positive, got {}", *c.memory_budget);
}

// When the run stops, fails on purpose or saves, and what it reads.
void check_schedule(const RunConfig& c) {
  if (c.stop_at < 0 || c.stop_at > c.steps) fail("--stop-at must be in [1, --steps {}], got {}", c.steps, c.stop_at);
  if (c.inject_oom && c.inject_oom->step > c.end_step()) {
    fail("--inject-oom {}: step {} never runs (the run ends at step {}); accepted: a step from 1 to {}",
         c.inject_oom->text(), c.inject_oom->step, c.end_step(), c.end_step());
  }
  if (c.stop_at > 0 && c.checkpoint.empty() && c.resume.empty()) {
    fail("--stop-at needs --checkpoint DIR (it saves the state to resume from)");
  }
  if (!c.weights.empty() && !std::filesystem::is_directory(c.weights)) {
    fail("--weights '{}': not a directory; accepted: a Hugging Face checkpoint directory (config.json and "
         "model.safetensors, or model.safetensors.index.json and its shards)",
         c.weights);
  }
}

// The ranks' layout: pipeline stages x tensor-parallel x data-parallel, and the levers each excludes.
void check_layout(const RunConfig& c) {
  if (c.pipeline.stages < 1 || c.pipeline.stages > 4096) {
    fail("--pipeline must be 1 to 4096 stages, got {}", c.pipeline.stages);
  }
  if (c.world_size > 0 && c.world_size % c.pipeline.stages != 0) {
    fail("--world-size {} is not a multiple of --pipeline {}; accepted: ranks = pipeline stages x data-parallel "
         "ranks",
         c.world_size, c.pipeline.stages);
  }
  if (c.tensor_parallel < 1 || c.tensor_parallel > 4096) {
    fail("--tensor-parallel must be 1 to 4096 ranks, got {}", c.tensor_parallel);
  }
  if (c.world_size > 0 && c.world_size % (c.pipeline.stages * c.tensor_parallel) != 0) {
    fail("--world-size {} is not a multiple of --pipeline {} x --tensor-parallel {}; accepted: ranks = pipeline "
         "stages x data-parallel ranks x tensor-parallel ranks",
         c.world_size, c.pipeline.stages, c.tensor_parallel);
  }
  if (!c.pipeline.split.empty() && static_cast<int64_t>(c.pipeline.split.size()) != c.pipeline.stages) {
    fail("--pipeline-split '{}' has {} stages and --pipeline is {}; accepted: one range per stage",
         pipeline_split_text(c.pipeline.split), c.pipeline.split.size(), c.pipeline.stages);
  }
  if (c.offload != Offload::none && world_size_of(c) > 1) {
    fail("--offload {} with {} data-parallel ranks: not supported yet; accepted: one process, or --shard optimizer to "
         "split the optimizer state over the ranks instead",
         offload_name(c.offload), world_size_of(c));
  }
  if (c.loss.chunked && c.shard == ShardLevel::full && world_size_of(c) > 1) {
    fail("--loss {} with --shard full: not supported yet (the head is released after the forward that gathers it); "
         "accepted: --loss full, or --shard optimizer or gradients",
         c.loss.name());
  }
}

// Fine-tuning's flags and the inputs that exclude each other.
void check_finetune_and_inputs(const RunConfig& c) {
  if (c.base_weights == BaseWeights::nf4 && !c.finetune.is_lora()) {
    fail("--base-weights nf4 needs --finetune lora:r=R,... (the 4-bit base is frozen; only adapters train)");
  }
  if (c.base_weights == BaseWeights::nf4 && c.merge_lora) {
    fail("--merge-lora with --base-weights nf4: merging into a 4-bit base is not supported; accepted: --save-weights "
         "alone, which writes the adapter (peft loads it over the original base)");
  }
  if (c.merge_lora && (!c.finetune.is_lora() || c.save_weights.empty())) {
    fail("--merge-lora needs --finetune lora:... and --save-weights DIR (it says how the adapters are saved)");
  }
  if (!c.adapter.empty() && !c.finetune.is_lora()) {
    fail("--adapter needs --finetune lora:r=R,... with the adapter's rank, alpha and targets");
  }
  if (!c.data.empty() && !c.data_tokens.empty()) {
    fail("--data and --data-tokens both given; accepted: one (text as bytes, or pre-tokenised ids)");
  }
  if (c.checkpoint_every > 0 && c.checkpoint.empty() && c.resume.empty()) {
    fail("--checkpoint-every needs --checkpoint DIR (where to write)");
  }
}

}  // namespace

void validate(const RunConfig& c) {
  check_numbers(c);
  check_schedule(c);
  check_layout(c);
  check_finetune_and_inputs(c);
}

}  // namespace headroom
