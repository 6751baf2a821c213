#include "cli/plan_command.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <thread>

#include "cli/run_flags.h"
#include "config/pipeline_layout.h"
#include "device/device.h"
#include "plan/plan_settings.h"
#include "plan/planner.h"
#include "train/step_timing.h"
#include "util/error.h"
#include "util/interrupt.h"
#include "util/json.h"
#include "util/size.h"

namespace headroom {
namespace {

struct PlanOptions {
  int64_t global_batch = 0;
  double margin = 0.05;
  bool allow_optimizer_change = false;
  std::vector<std::string> allow;  // --allow: optimizer, adamw8bit, offload
  bool calibrate = true;
  int64_t top = 10;
  bool exhaustive = false;  // --exhaustive: every candidate estimated, however many
  std::string emit;  // "hf", "lightning", "torch" or "toml": the best plan as settings to paste
  double flops = 1e12;                             // --flops-per-second
  double link = CostModel::kLinkBytesPerSecond;    // --link-bytes-per-second
  double node_link = CostModel::kNodeLinkBytesPerSecond;  // --node-link-bytes-per-second
  int64_t gpus_per_node = 8;                               // --gpus-per-node
};

// The best plan as the settings --emit names: Python source, or a run file.
std::string emitted(const RunConfig& cfg, const PlanOptions& o, const Plan& best, int64_t budget) {
  if (o.emit == "hf") return training_arguments_code(best);
  if (o.emit == "lightning") return lightning_trainer_code(best);
  if (o.emit == "toml") {
    // A run file for `headroom train --config`: the plan on the model and budget planned for, the
    // sequences per step kept; the planner's own outputs (--json, --quiet) are not the run's.
    RunConfig run = with_plan(cfg, best);
    run.json = run.quiet = false;
    run.memory_budget = budget;
    return run_toml(run, RunConfig{}, plan_keys());
  }
  return torch_loop_code(best, resolve_device(cfg.device).is_cuda() ? "cuda" : "cpu");
}

// The planner with the cost model calibrated on this machine (unless --no-calibrate).
PlanResult plan(const RunConfig& cfg, const PlanOptions& o, const PlanRequest& request) {
  CostModel::StepTimer timer;
  CostModel::LinkTimer link;
  if (o.calibrate) {
    install_interrupt_handlers();  // the timed steps stop at a Ctrl-C
    timer = [&cfg](Precision p, int64_t rows, int timed) { return time_train_step(cfg, p, rows, timed); };
    link = [&cfg] { return host_link_bytes_per_second(cfg.device); };
  }
  return plan_with_calibration(
      request, timer, {},
      [&cfg](const std::string& line) {
        if (!cfg.quiet) fmt::print(stderr, "{}...\n", line);
      },
      link);
}

PlanRequest request_of(const RunConfig& cfg, const PlanOptions& o, const std::string& command) {
  PlanRequest r;
  r.base = cfg;
  r.global_batch = o.global_batch;
  r.budget = device_budget(cfg, command);
  r.margin = o.margin;
  r.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  r.assumed_flops = o.flops;
  r.link_bytes_per_second = o.link;
  r.node_link_bytes_per_second = o.node_link;
  r.max_tensor_parallel = o.gpus_per_node;
  if (!o.exhaustive) r.best_only = std::max<int64_t>(o.top, 10);
  r.allow_optimizer_change = o.allow_optimizer_change;
  for (const std::string& lever : o.allow) {
    if (lever == "optimizer") r.allow_optimizer_change = true;
    if (lever == "adamw8bit") r.allow_adamw8bit = true;
    if (lever == "offload") r.allow_offload = true;
  }
  return r;
}

[[noreturn]] void nothing_fits(const PlanResult& result, const PlanRequest& r, bool can_allow_optimizer_change) {
  throw DoesNotFit(fmt::format(
      "no plan fits {} (less the {:.0f}% margin): the smallest predicted peak is {} ({}); other levers: {}a shorter "
      "--seq, or a larger budget",
      format_bytes(r.budget), 100 * r.margin, format_bytes(result.smallest_peak), result.smallest_peak_plan,
      r.allow_optimizer_change ? ""
      : can_allow_optimizer_change
          ? fmt::format("{}{}a lighter optimizer (--allow optimizer), ",
                        r.allow_adamw8bit || !is_adam_family(r.base.optimizer) ? "" : "8-bit states (--allow adamw8bit), ",
                        r.allow_offload || world_size_of(r.base) > 1 ? "" : "the optimizer in host memory (--allow offload), ")
          : "a lighter --optimizer (adafactor, sgd), 8-bit states (--optimizer adamw8bit), --offload optimizer, "));
}

// --plan's options beyond the run's flags.
void add_plan_options(CLI::App* cmd, PlanOptions& o) {
  cmd->add_option("--global-batch", o.global_batch, "sequences per optimizer step (required)")
      ->required()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--margin", o.margin, "fraction of the budget kept free (default 0.05)")->check(CLI::Range(0.0, 0.9));
  cmd->add_option("--allow", o.allow,
                  "levers the planner may also use, comma-separated: optimizer (any other optimizer: they change\n"
                  "the training dynamics), adamw8bit (Adam's or AdamW's update with 8-bit states), offload (the\n"
                  "optimizer's state and update in host memory, one process)")
      ->delimiter(',')
      ->check(CLI::IsMember({"optimizer", "adamw8bit", "offload"}));
  cmd->add_flag("--allow-optimizer-change", o.allow_optimizer_change, "the same as --allow optimizer");
  cmd->add_flag("!--no-calibrate", o.calibrate, "rank by FLOPs alone, without timing steps on this machine");
  cmd->add_option("--emit", o.emit,
                  "also print the best plan as settings to paste: hf (transformers TrainingArguments and\n"
                  "from_pretrained arguments), lightning (lightning.Trainer arguments and what the\n"
                  "LightningModule enables), torch (a plain loop: accumulation, autocast, checkpointing) or\n"
                  "toml (a run file for headroom train --config)")
      ->check(CLI::IsMember({"hf", "lightning", "torch", "toml"}));
  cmd->add_option("--flops-per-second", o.flops,
                  "compute rate assumed when steps are not timed (--no-calibrate, or planning for a device this\n"
                  "machine lacks): a card's realised dense rate, e.g. 4e14 for an H100 at 40% of its bf16 peak\n"
                  "(default 1e12)")
      ->check(CLI::Range(1e6, 1e18));
  cmd->add_option("--link-bytes-per-second", o.link,
                  "the link between ranks that collectives and pipeline transfers cross, bytes a second each way\n"
                  "(default 5e9; NVLink within a node is nearer 3e11, InfiniBand between nodes 2.5e10 to 5e10)")
      ->check(CLI::Range(1e6, 1e13));
  cmd->add_option("--node-link-bytes-per-second", o.node_link,
                  "the link inside a node that tensor-parallel sums cross, bytes a second each way (default 1.5e11,\n"
                  "an NVLink's order)")
      ->check(CLI::Range(1e6, 1e13));
  cmd->add_option("--gpus-per-node", o.gpus_per_node,
                  "the most tensor-parallel ranks a plan may use: they stay inside a node (default 8)")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}));
  cmd->add_option("--top", o.top, "plans to list (default 10; --json lists all it found)")
      ->check(CLI::Range(1, 100000));
  cmd->add_flag("--exhaustive", o.exhaustive,
                "estimate every candidate, however many (default: beyond 2,000 layouts and settings, the candidates\n"
                "are estimated in the order of a bound on their step time that no estimate lowers, until none left\n"
                "can beat the --top fastest found: those are exact, the rest are not estimated)");
}

// The plans found, one line each, with the columns the plans need (offload, layout, shard).
void print_plan_table(const PlanResult& result, size_t n, bool ranks, bool pipelines, bool offloads) {
  size_t offload_width = 7, loss_width = 4;
  for (size_t i = 0; i < n; ++i) {
    offload_width = std::max(offload_width, std::string(offload_name(result.plans[i].offload)).size());
    loss_width = std::max(loss_width, result.plans[i].loss.name().size());
  }
  auto offload_cell = [&](const std::string& text) {
    return offloads ? fmt::format("{:<{}} ", text, offload_width) : std::string();
  };
  fmt::print("{:>6} {:>6}  {:<11} {:<13} {:<6} {:<10} {:<{}} {}{}{}{:>11} {:>10}\n", "micro", "accum", "precision",
             "checkpoint", "attn", "optimizer", "loss", loss_width, offload_cell("offload"),
             pipelines ? fmt::format("{:<9} ", "layout") : "", ranks ? fmt::format("{:<10} ", "shard") : "",
             ranks ? "peak/rank" : "peak", "step time");
  for (size_t i = 0; i < n; ++i) {
    const Plan& p = result.plans[i];
    fmt::print(
        "{:>6} {:>6}  {:<11} {:<13} {:<6} {:<10} {:<{}} {}{}{}{:>11} {:>9.2f}x\n", p.batch, p.accum,
        precision_name(p.precision), p.checkpointing.name(), attention_path_name(p.attention),
        optimizer_name(p.optimizer), p.loss.name(), loss_width, offload_cell(offload_name(p.offload)),
        pipelines ? fmt::format("{:<9} ", fmt::format("{}x{}x{}", p.pipeline.stages, p.tensor_parallel, p.world)) : "",
        ranks ? fmt::format("{:<10} ", p.world > 1 ? shard_level_name(p.shard) : "-") : "",
        format_bytes(p.predicted_peak_bytes), p.predicted_step_time_ratio);
  }
}

// The fastest plan's step time by its terms (ranks only).
void print_step_terms(const PlanResult& result) {
  const Plan& best = result.plans.front();
  const Plan::Terms& t = best.terms;
  fmt::print(
      "\nThe fastest plan's step, {:.3g} s: compute {:.3g} s{}, pipeline bubble {:.3g} s, transfers between "
      "stages {:.3g} s, data-parallel collectives {:.3g} s, tensor-parallel sums {:.3g} s, other {:.3g} s "
      "(compute {}; collectives and transfers at an assumed {:.3g} GB/s link, tensor-parallel sums at an "
      "assumed {:.3g} GB/s inside a node).\n",
      best.predicted_step_seconds, t.compute,
      best.pipeline.stages > 1
          ? fmt::format(" (the {} stages' largest share of every micro-batch; layers cut --pipeline-split {}, {})",
                        best.pipeline.stages, pipeline_split_text(best.pipeline.split),
                        best.pipeline.split == even_cut(best.pipeline.split.back().end, best.pipeline.stages)
                            ? "as evenly as they go"
                            : "balanced by memory")
      : best.tensor_parallel > 1 ? fmt::format(" (1/{} of every matmul per rank)", best.tensor_parallel)
                                 : "",
      t.bubble, t.pipeline_transfers, t.collectives, t.tensor_collectives, t.other,
      result.calibrated ? "timed on this machine"
                        : fmt::format("not timed: FLOPs at an assumed {:.3g} FLOP/s", result.assumed_flops),
      result.link_bytes_per_second / 1e9, result.node_link_bytes_per_second / 1e9);
}

// The fastest plan as the command that trains it (on every rank, under torchrun, where ranks).
void print_run_command(const RunConfig& cfg, const PlanOptions& o, const PlanRequest& r, const Plan& best) {
  RunConfig run = with_plan(cfg, best);
  run.json = run.quiet = false;
  run.memory_budget = r.budget;
  const int64_t world = world_size_of(cfg);
  const int64_t per_node = std::min(world, o.gpus_per_node);
  fmt::print("\nTo train the fastest: {}headroom train {}\n",
             world > 1 ? fmt::format("torchrun --nnodes {} --nproc-per-node {} --no-python ",
                                     (world + per_node - 1) / per_node, per_node)
                       : "",
             shell_line(run_args(run, RunConfig{}, plan_keys())));
}

void print_plans(const RunConfig& cfg, const PlanOptions& o, const PlanRequest& r, const PlanResult& result) {
  if (result.estimated < result.considered) {
    fmt::print(
        "the {} fastest plans that fit {} (less {:.0f}%) of {} considered ({} estimated; none left could "
        "be faster), fastest first:\n\n",
        result.plans.size(), format_bytes(r.budget), 100 * r.margin, result.considered, result.estimated);
  } else {
    fmt::print("{} plans of {} fit {} (less {:.0f}%), fastest first:\n\n", result.plans.size(), result.considered,
               format_bytes(r.budget), 100 * r.margin);
  }
  const bool ranks = world_size_of(cfg) > 1;
  const bool pipelines = std::any_of(result.plans.begin(), result.plans.end(),
                                     [](const Plan& p) { return p.pipeline.stages > 1 || p.tensor_parallel > 1; });
  const bool offloads = r.allow_offload || r.base.offload != Offload::none;
  const size_t n = std::min<size_t>(result.plans.size(), static_cast<size_t>(o.top));
  print_plan_table(result, n, ranks, pipelines, offloads);
  if (ranks && n > 0) {
    print_step_terms(result);
    if (pipelines) {
      fmt::print(
          "layout: pipeline stages x tensor-parallel ranks x data-parallel ranks; peak/rank is the "
          "largest stage's or share's.\n");
    }
  }
  if (n > 0) print_run_command(cfg, o, r, result.plans.front());
  if (offloads) {
    fmt::print("\nOffloaded bytes costed at {:.1f} GB/s each way to host memory ({}).\n",
               result.host_link_bytes_per_second / 1e9,
               result.host_link_measured ? "measured on this machine" : "assumed, not measured");
  }
  if (!o.emit.empty()) {
    fmt::print("\nThe fastest plan, {}:\n\n{}",
               o.emit == "hf"          ? "for transformers' Trainer"
               : o.emit == "lightning" ? "for Lightning's Trainer"
               : o.emit == "toml"      ? "as a run file for headroom train --config"
                                       : "in a plain PyTorch loop",
               emitted(cfg, o, result.plans.front(), r.budget));
  }
}

int run_plan(const RunConfig& cfg, const PlanOptions& o) {
  validate(cfg);
  const PlanRequest r = request_of(cfg, o, "plan");
  PlanResult result = plan(cfg, o, r);
  if (cfg.json) {
    nlohmann::json j = result.to_json();
    j["global_batch"] = o.global_batch;
    j["budget_bytes"] = r.budget;
    if (!o.emit.empty() && !result.plans.empty()) {
      j["emit"] = {{"format", o.emit}, {"code", emitted(cfg, o, result.plans.front(), r.budget)}};
      if (o.emit == "hf") j["emit"]["settings"] = training_arguments(result.plans.front());
      if (o.emit == "lightning") j["emit"]["settings"] = lightning_trainer_kwargs(result.plans.front());
    }
    fmt::print("{}\n", dump_json(j));
  }
  if (result.plans.empty()) {
    if (cfg.json) return kExitOom;
    nothing_fits(result, r, true);
  }
  if (!cfg.json) print_plans(cfg, o, r, result);
  return 0;
}

}  // namespace

RunConfig choose_plan(const RunConfig& cfg) {
  PlanOptions o;
  o.global_batch = cfg.batch * cfg.accum * world_size_of(cfg);
  // Data-parallel ranks must choose the same plan: timings differ between processes, FLOPs do not.
  if (world_size_of(cfg) > 1) o.calibrate = false;
  const PlanRequest r = request_of(cfg, o, "--plan auto");
  const PlanResult result = plan(cfg, o, r);
  if (result.plans.empty()) nothing_fits(result, r, false);
  const Plan& best = result.plans.front();
  if (!cfg.quiet) {
    fmt::print(stderr, "plan: {} — predicted peak {} of {} (best of {} that fit, {} considered)\n", best.describe(),
               format_bytes(best.predicted_peak_bytes), format_bytes(r.budget), result.plans.size(), result.considered);
  }
  return with_plan(cfg, best);
}

void add_plan_command(CLI::App& app, std::function<int()>& run) {
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Rank the ways to train --global-batch sequences per step within the memory budget: micro-batch x\n"
      "accumulation, precision, checkpointing and attention (the optimizer, its 8-bit states and its offload\n"
      "to host memory only where --allow lists them), peak predicted by the estimator, step time by a cost\n"
      "model calibrated with a few timed steps on this machine (and, where a plan offloads, timed copies\n"
      "to host memory and back). With --world-size N (ranks under torchrun) the layout is a lever too:\n"
      "P pipeline stages (each divisor of N up to the layers), or T tensor-parallel ranks inside a node\n"
      "(each divisor up to --gpus-per-node that the heads, MLP and vocabulary split over), of N/(P·T)\n"
      "data-parallel ranks, which split the global batch, and the shard level (none, optimizer, gradients,\n"
      "full) within them; peaks are per rank (the largest stage's or share's), and the step's compute,\n"
      "pipeline bubble, transfers between stages, data-parallel collectives and tensor-parallel sums are\n"
      "printed, the last three at assumed link speeds; nothing is launched (the calibration times one\n"
      "process). Exit code 3 when nothing fits.");
  auto config = bind_run_flags(cmd, {"model", "set", "data", "data-tokens", "weights", "seq", "seed", "device", "precision", "optimizer",
                                     "optimizer-impl", "moe-routing", "finetune", "base-weights", "offload", "loss", "memory-budget", "threads", "world-size", "json",
                                     "quiet"});
  auto o = std::make_shared<PlanOptions>();
  add_plan_options(cmd, *o);
  cmd->callback([config, o, &run] { run = [config, o]() -> int { return run_plan(config(), *o); }; });
}

}  // namespace headroom
