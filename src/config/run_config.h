// RunConfig — everything one `headroom train` run is told: model, data, schedule, levers, outputs.
//
// Typed: each setting is parsed once, where it enters (a flag or a TOML key, through the field
// table), and printed by name only at output; the levers' settings are the enums and structs of
// config/ (Precision, OptimizerKind, CheckpointPolicy, AttentionPath). Sources, in increasing precedence: the defaults
// below, a TOML file (--config run.toml, keys named as the long flags: `steps = 200`, `set = ["num_hidden_layers=2"]`),
// then command-line flags. The field table (run_fields) is the one list of settings; the CLI and the TOML reader both
// use it, so a setting cannot exist in one and not the other.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "config/attention_path.h"
#include "config/checkpoint_policy.h"
#include "config/optimizer_kind.h"
#include "config/precision.h"
#include "config/shard_level.h"

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

struct RunConfig {
  std::string model = "tiny";
  std::vector<std::string> overrides;  // --set key=value
  std::string data;                    // empty: the bundled corpus
  int64_t steps = 200;
  int64_t batch = 8;  // micro-batch, sequences
  int64_t accum = 1;  // micro-batches per optimizer step
  int64_t seq = 128;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio
  int64_t warmup = -1;        // steps; -1: 5% of --steps (at least 1)
  OptimizerKind optimizer = OptimizerKind::adamw;
  OptimizerImpl optimizer_impl = OptimizerImpl::headroom;  // estimate, plan: whose update to predict
  double weight_decay = -1;  // -1: 0.1 for adamw, 0 for the others
  double grad_clip = 1.0;    // max global grad norm; 0 turns clipping off
  uint64_t seed = 1234;
  std::string device = "auto";
  int64_t threads = 0;  // cpu intra-op threads; 0: the cores free now (device/device.h)
  AttentionPath attention = AttentionPath::flash;
  Precision precision = Precision::fp32;
  CheckpointPolicy checkpointing;
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
  // Data parallel (lever 6), when launched by torchrun: how the state is spread over the ranks, and
  // how long a rank waits for the others (rendezvous, each collective) before giving up.
  ShardLevel shard = ShardLevel::none;
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
// flag's name and what it accepts.
struct RunField {
  enum class Kind { integer, number, text, list, flag };
  std::string key;  // flag name without dashes, and TOML key
  Kind kind;
  std::string help;
  std::function<void(RunConfig&, const std::string&)> set;
};

const std::vector<RunField>& run_fields();

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
