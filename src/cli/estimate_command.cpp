#include "cli/estimate_command.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>

#include "cli/run_flags.h"
#include "estimate/estimator.h"
#include "model/tensor_parallel.h"
#include "util/error.h"
#include "util/json.h"
#include "util/size.h"

namespace headroom {
namespace {

nlohmann::json estimate_json(const ModelConfig& model, const TrainSpec& spec, const Estimate& e,
                             std::optional<int64_t> budget, bool fits) {
  nlohmann::json j = e.to_json();
  if (spec.tensor_parallel > 1) {
    j["tensor_parallel"] = {{"ranks", spec.tensor_parallel},
                            {"rank", spec.tensor_parallel - 1},
                            {"kv_replication", kv_replication_note(model, spec.tensor_parallel)}};
  }
  if (budget) {
    j["budget_bytes"] = *budget;
    j["fits"] = fits;
  }
  return j;
}

// The run's line above the table: the model, the step's settings, and whose peak it is.
void print_run_line(const ModelConfig& model, const TrainSpec& spec, const Estimate& e) {
  fmt::print(
      "{} ({}, {:.3f}B params{}), batch {} x accum {}{} x seq {}, {}, {}, checkpointing {}, attention {}{}{}, "
      "on {}{}\n\n{}",
      model.name, family_name(model.family), static_cast<double>(e.params) / 1e9,
      spec.finetune.full() ? std::string()
                           : fmt::format(", {} trained: --finetune {}", e.trainable_params, spec.finetune.name()),
      spec.batch, spec.accum, spec.world > 1 ? fmt::format(" x {} ranks", spec.world) : "", spec.seq,
      precision_name(spec.precision), optimizer_name(spec.optimizer), spec.checkpointing.name(),
      attention_path_name(spec.attention), spec.loss.chunked ? ", loss " + spec.loss.name() : "",
      spec.offload == Offload::none ? "" : fmt::format(", offload {}", offload_name(spec.offload)),
      spec.cuda ? "cuda" : "cpu",
      spec.tensor_parallel > 1 ? fmt::format("; per rank: the share of tensor-parallel rank {} of {}{}{}",
                                             spec.tensor_parallel - 1, spec.tensor_parallel,
                                             spec.world > 1 ? fmt::format(", --shard {} over {} data-parallel ranks",
                                                                          shard_level_name(spec.shard), spec.world)
                                                            : "",
                                             kv_replication_note(model, spec.tensor_parallel).empty()
                                                 ? ""
                                                 : "; " + kv_replication_note(model, spec.tensor_parallel))
      : spec.world > 1 ? fmt::format("; per rank (rank 0), --shard {}", shard_level_name(spec.shard))
      : spec.pipeline.stages > 1
          ? fmt::format("; {} pipeline stages, one rank each: the largest is stage {}", spec.pipeline.stages, e.stage)
          : "",
      e.table());
}

// Whether the estimate fits --memory-budget, and by how much.
void print_budget(const TrainSpec& spec, const Estimate& e, int64_t budget, bool fits) {
  if (e.reserved && e.reserved->oom && e.peak_bytes <= budget) {
    fmt::print(
        "\ndoes NOT fit the budget of {}: live bytes would, but the caching allocator's segments "
        "would not (fragmentation){}\n",
        format_bytes(budget),
        spec.caching->expandable_segments ? "" : "; try --allocator-conf expandable_segments:True");
  } else {
    const int64_t used = e.reserved ? std::max(e.peak_bytes, e.reserved->peak_reserved) : e.peak_bytes;
    fmt::print("\n{} the budget of {} ({} {})\n", fits ? "fits" : "does NOT fit", format_bytes(budget),
               format_bytes(fits ? std::max<int64_t>(0, budget - used) : e.peak_bytes - budget),
               fits ? "to spare" : "over");
  }
}

int run_estimate(const RunConfig& cfg) {
  validate(cfg);
  const auto start = std::chrono::steady_clock::now();
  const ModelConfig model = load_model_config(cfg.model, cfg.overrides);
  const TrainSpec spec = train_spec(cfg);
  const Estimate e = estimate(model, spec);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const auto budget = cfg.memory_budget;
  // With a caching allocator the replay ran under the cap: fragmentation can fail it below the budget.
  const bool fits = !budget || (e.peak_bytes <= *budget && !(e.reserved && e.reserved->oom));
  if (cfg.json) {
    fmt::print("{}\n", dump_json(estimate_json(model, spec, e, budget, fits)));
  } else {
    print_run_line(model, spec, e);
    if (budget) print_budget(spec, e, *budget, fits);
  }
  if (!cfg.quiet) fmt::print(stderr, "\nestimated in {:.1f} ms\n", ms);
  return fits ? 0 : kExitOom;
}

}  // namespace

void add_estimate_command(CLI::App& app, std::function<int()>& run) {
  CLI::App* cmd =
      app.add_subcommand("estimate",
                         "Predict a training step's peak memory and what it consists of, without running it.\n"
                         "With a caching allocator (--device cuda, or --allocator caching on cpu) also predict\n"
                         "reserved memory, by replaying the step through PyTorch's allocator policy.\n"
                         "With --memory-budget, also say whether it fits (exit code 3 when it does not): with a\n"
                         "caching allocator, by reserved memory under that cap.\n"
                         "With --pipeline P, each stage's peak (one rank each, 1F1B); the table is the largest's.\n"
                         "With --tensor-parallel T, one rank's share of each layer and of the vocabulary (the last\n"
                         "rank's, which holds the most vocabulary rows).");
  auto config = bind_run_flags(cmd, {"model", "set", "data", "data-tokens", "weights", "batch", "accum", "seq", "device", "attention", "moe-routing", "finetune", "base-weights", "offload", "loss",
                                     "precision", "checkpointing", "optimizer", "optimizer-impl", "memory-budget",
                                     "allocator", "allocator-conf", "world-size", "shard", "pipeline", "pipeline-split",
                                     "tensor-parallel", "sequence-parallel", "reshard-after-forward", "json",
                                     "quiet"});
  cmd->callback([config, &run] { run = [config]() -> int { return run_estimate(config()); }; });
}

}  // namespace headroom
