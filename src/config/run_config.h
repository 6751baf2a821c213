// RunConfig — everything one `headroom train` run is told: model, data, schedule, levers, outputs.
//
// Typed: each setting is parsed once, where it enters (a flag, a TOML key or a Python keyword
// argument, through the field table), and printed by name only at output; the step's levers are
// its StepSettings (config/step_settings.h), shared whole with the estimator's spec and the plan.
// Sources, in increasing precedence: the defaults below, a TOML file (--config run.toml, keys named
// as the long flags: `steps = 200`, `set = ["num_hidden_layers=2"]`), then command-line flags.
//
// The field table (run_fields) is the one list of settings. It reads them (the CLI's flags, the
// TOML reader, the Python module's keyword arguments) and writes them back (run_args: a command
// line, run_toml: a run file), so a setting cannot exist in one and not the other. A new setting is
// its member here (or in StepSettings), its row in run_fields(), and the code that acts on it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "config/step_settings.h"

namespace headroom {

// A leak planted on purpose, for the leak detector (--inject-leak).
enum class LeakInjection {
  none,
  keep_graph,    // losses summed without detaching, backward told to retain the graph
  keep_outputs,  // each step's logits kept
};
const char* leak_injection_name(LeakInjection leak);

// A fault injected on purpose (--inject-oom, cpu): one allocation of one step fails as if out of memory.
struct OomInjection {
  int64_t step = 0;          // 1-based optimizer step
  int64_t nth = 0;           // > 0: fail the n-th allocation of that step
  int64_t above_bytes = -1;  // >= 0: fail its first allocation larger than this
  int rank = -1;             // data-parallel runs: only on this rank ("2:150@1"); -1: every rank
  std::string given;         // the flag's text, for messages
  std::string text() const;  // as given: "2:150", "3:above:1MiB", "2:150@1"
};

// How cpu memory is served (cuda always has PyTorch's caching allocator).
enum class AllocatorKind {
  counting,  // every allocation from the system allocator, counted; the budget caps live bytes
  caching,   // PyTorch's CUDA caching allocator reproduced; the budget caps reserved bytes
};
const char* allocator_kind_name(AllocatorKind a);

struct RunConfig : StepSettings {
  std::string model = "tiny";
  std::vector<std::string> overrides;  // --set key=value
  std::string data;                    // empty: the bundled corpus
  // Pre-tokenised ids (data/token_file.h) instead of --data's bytes; the model's own vocabulary.
  std::string data_tokens;
  // A Hugging Face checkpoint directory to start from (model/hf_weights.h); the model's config
  // defaults to its config.json.
  std::string weights;
  std::string save_weights;  // at the end, the trained weights as a Hugging Face checkpoint here
  bool merge_lora = false;   // --save-weights with LoRA: the adapters merged into the weights, not a peft adapter
  std::string adapter;       // a peft LoRA adapter directory to start the adapters from
  int64_t steps = 200;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio
  int64_t warmup = -1;        // steps; -1: 5% of --steps (at least 1)
  double weight_decay = -1;  // -1: 0.1 for adamw, 0 for the others
  double grad_clip = 1.0;    // max global grad norm; 0 turns clipping off
  uint64_t seed = 1234;
  std::string device = "auto";
  int64_t threads = 0;  // cpu intra-op threads; 0: the cores free now (device/device.h)
  std::optional<int64_t> memory_budget;  // bytes; none: the device's own. cpu: a simulated device; cuda: a cap
  AllocatorKind allocator = AllocatorKind::counting;
  // The caching allocator's settings in PYTORCH_CUDA_ALLOC_CONF's syntax; empty: the environment's
  // (PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF).
  std::string allocator_conf;
  std::string memory_snapshot;  // write the allocator's memory snapshot pickle here at the end (and on OOM)
  std::optional<OomInjection> inject_oom;
  LeakInjection inject_leak = LeakInjection::none;
  std::string metrics;           // JSONL path
  std::string checkpoint;        // directory
  int64_t checkpoint_every = 0;  // steps; 0: only at the end
  int64_t stop_at = 0;           // stop (with a checkpoint) after this step; 0: run to --steps
  std::string resume;            // directory
  int64_t eval_every = 0;        // steps; 0: only at the end
  int64_t eval_rows = 64;        // held-out windows per evaluation; 0: none
  bool plan_auto = false;        // --plan auto: choose the fastest plan that fits before training
  bool no_guard = false;         // OOM guard off: an OOM ends the run
  // Data parallel (lever 6), when launched by torchrun (the shard level is a StepSettings): how long
  // a rank waits for the others (rendezvous, each collective) before giving up.
  int64_t dist_timeout = 300;  // seconds
  int64_t world_size = 0;      // ranks to predict and plan for; 0: WORLD_SIZE's (torchrun), else 1
  // cuda: tag allocations with their step and phase so that TrainSummary::surviving names leak
  // sites (the doctor's leak check; a little cost per allocation). Not a flag; cpu always tags.
  bool leak_origins = false;
  bool json = false;
  bool quiet = false;

  int64_t warmup_steps() const;
  double weight_decay_value() const;
  // The last step this process runs: --stop-at when given, else --steps.
  int64_t end_step() const { return stop_at > 0 ? stop_at : steps; }
};

// One setting. kind says how its text is read; `set` parses and stores it, throwing Error with the
// flag's name and what it accepts; `get` writes it back as the texts `set` reads to the same value
// (one per item of a list, "true" or "false" for a flag, none for an optional that is unset).
struct RunField {
  enum class Kind { integer, number, text, list, flag };
  std::string key;  // flag name without dashes, and TOML key
  Kind kind;
  std::string help;
  std::function<void(RunConfig&, const std::string&)> set;
  std::function<std::vector<std::string>(const RunConfig&)> get;
};

const std::vector<RunField>& run_fields();

// The field of `key`, or null.
const RunField* find_run_field(const std::string& key);

// The flags that turn `base` into `config`: "--key value" for every setting whose value differs,
// in the table's order (a list's items each as "--set item", a flag as "--key"), and for the keys
// in `always` even when equal. Sizes are written as sizes ("140MiB"). Parsed by the CLI on top of
// `base`, they give `config` back.
std::vector<std::string> run_args(const RunConfig& config, const RunConfig& base = {},
                                  const std::vector<std::string>& always = {});

// `args` as one line for a POSIX shell, each argument quoted where the shell would split or
// expand it.
std::string shell_line(const std::vector<std::string>& args);

// `config` as a TOML run file (--config): the settings that differ from `base` and those in
// `always`, one `key = value` a line, which apply_toml_file reads back to `config`.
std::string run_toml(const RunConfig& config, const RunConfig& base = {}, const std::vector<std::string>& always = {});

// Applies a TOML file's settings to `config`. Throws Error on a parse error (with line and column),
// an unknown key (listing the accepted ones) or a bad value.
void apply_toml_file(RunConfig& config, const std::string& path);

// Parses --inject-oom's text; throws Error naming the accepted forms.
OomInjection parse_oom_injection(const std::string& text);

// `config` as a short measuring run of `steps` steps: no OOM guard, no evaluation, no progress, no
// outputs (metrics, checkpoints, snapshot), no resume, stop-at, plan or injected OOM, the default
// warm-up. What it
// trains (model, shapes, precision, budget, an injected leak) is kept.
RunConfig as_trial(RunConfig config, int64_t steps);

// The data-parallel ranks `config` is for: --world-size when given, else the environment's
// WORLD_SIZE (under torchrun), else 1.
int64_t world_size_of(const RunConfig& config);

// Checks ranges and combinations after all sources are applied; throws Error naming the flag.
void validate(const RunConfig& config);

}  // namespace headroom
