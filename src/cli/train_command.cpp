#include "cli/train_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/plan_command.h"
#include "cli/run_flags.h"
#include "config/model_config.h"
#include "estimate/estimator.h"
#include "plan/oom_advice.h"
#include "train/trainer.h"
#include "util/error.h"
#include "util/interrupt.h"
#include "util/json.h"
#include "util/size.h"

namespace headroom {
namespace {

// The configuration to train: the planner's choice under --plan auto, validated.
RunConfig resolved(RunConfig cfg) {
  if (cfg.plan_auto) {
    validate(cfg);
    cfg = choose_plan(cfg);
  }
  validate(cfg);
  return cfg;
}

// No allocation of a step is larger than the step's whole peak: an injection above it would never
// fire.
void check_injection_can_fire(const RunConfig& cfg) {
  if (!cfg.inject_oom || cfg.inject_oom->above_bytes < 0) return;
  const int64_t peak = estimate(load_model_config(cfg.model, cfg.overrides), train_spec(cfg)).peak_bytes;
  if (cfg.inject_oom->above_bytes >= peak) {
    fail(
        "--inject-oom {}: no allocation of a step is that large (the whole step's peak is estimated at {}); "
        "accepted: a size below it",
        cfg.inject_oom->text(), format_bytes(peak));
  }
}

// Out of memory: the trainer reports; the advice (the estimator's numbers for each lever) is
// composed here.
int report_oom(const TrainResult& result, const RunConfig& cfg, bool speaks) {
  OomReport report = *result.oom;
  if (!report.elsewhere) report.advice = oom_advice(report, cfg);
  if (speaks) fmt::print(stderr, "headroom: {}\n", report.to_text());
  if (cfg.json && speaks) {
    fmt::print("{}\n", dump_json({{"error", report.message},
                                  {"kind", "out of memory"},
                                  {"exit_code", kExitOom},
                                  {"steps", result.summary.steps},
                                  {"oom", report.to_json()}}));
  }
  return kExitOom;
}

int report_divergence(const TrainResult& result, const RunConfig& cfg, bool speaks) {
  const std::string message = result.diverged->message();
  if (speaks) fmt::print(stderr, "headroom: {}\n", message);
  if (cfg.json && speaks) {
    fmt::print("{}\n", dump_json({{"error", message},
                                  {"kind", "diverged"},
                                  {"exit_code", kExitDiverged},
                                  {"step", result.diverged->step}}));
  }
  return kExitDiverged;
}

int report_interruption(const TrainResult& result, const RunConfig& cfg, bool speaks) {
  const TrainSummary& s = result.summary;
  const std::string dir = !cfg.checkpoint.empty() ? cfg.checkpoint : cfg.resume;
  const std::string message =
      fmt::format("interrupted by {} after step {}; {}", signal_name(result.interrupted), s.steps,
                  dir.empty() ? "no checkpoint was configured (--checkpoint DIR keeps the state)"
                              : fmt::format("checkpoint saved in {} (continue with --resume {})", dir, dir));
  if (speaks) fmt::print(stderr, "headroom: {}\n", message);
  if (cfg.json && speaks) {
    fmt::print("{}\n", dump_json({{"error", message},
                                  {"kind", "interrupted"},
                                  {"exit_code", 128 + result.interrupted},
                                  {"steps", s.steps}}));
  }
  return 128 + result.interrupted;
}

// The finished run's summary as --json prints it.
nlohmann::json summary_json(const TrainSummary& s, const RunConfig& cfg) {
  nlohmann::json out = {{"params", s.params},
                        {"trainable_params", s.trainable_params},
                        {"steps", s.steps},
                        {"final_loss", s.final_loss},
                        {"eval_loss", std::isnan(s.eval_loss) ? nlohmann::json() : nlohmann::json(s.eval_loss)},
                        {"tokens_per_s", s.tokens_per_s},
                        {"peak_bytes", s.peak_bytes},
                        {"seconds", s.seconds},
                        {"device", s.device}};
  if (s.peak_reserved_bytes) out["peak_reserved_bytes"] = *s.peak_reserved_bytes;
  if (s.host_bytes) out["host_bytes"] = *s.host_bytes;
  if (s.routing_skew) out["routing_skew"] = *s.routing_skew;
  if (s.ranks > 1) {
    out["ranks"] = s.ranks;
    out["shard"] = shard_level_name(cfg.shard);
    out["rank_peak_bytes"] = s.rank_peak_bytes;
  }
  return out;
}

// The finished run's summary on stderr: memory by phase, then the one "done:" line.
void print_summary_text(const TrainSummary& s) {
  fmt::print(stderr, "\nmemory by phase, at each phase's highest peak — {}:\n{}\n", s.memory_source, s.memory_table);
  std::string ranks;
  if (s.ranks > 1) {
    std::vector<std::string> peaks;
    for (const int64_t b : s.rank_peak_bytes) peaks.push_back(format_bytes(b));
    ranks = fmt::format(" on rank 0; per rank: {}", fmt::join(peaks, ", "));
  }
  fmt::print(stderr, "done: {} steps, final loss {:.4f}, eval loss {:.4f}, {:.0f} tok/s, peak {}{}{}{}\n", s.steps,
             s.final_loss, s.eval_loss, s.tokens_per_s, format_bytes(s.peak_bytes),
             s.peak_reserved_bytes ? fmt::format(" ({} reserved)", format_bytes(*s.peak_reserved_bytes)) : "",
             s.host_bytes ? fmt::format(", host {} (offloaded)", format_bytes(*s.host_bytes)) : "", ranks);
  if (s.routing_skew) {
    fmt::print(stderr,
               "routing: the busiest expert took {:.2f}x a balanced share; estimate with this skew: "
               "--moe-routing {:.2f}\n",
               *s.routing_skew, *s.routing_skew);
  }
}

// `headroom train` with its flags read: trains, reports, returns the exit code.
int run_train(const RunConfig& flags) {
  const RunConfig cfg = resolved(flags);
  install_interrupt_handlers();  // Ctrl-C and SIGTERM stop after the step in flight, with a checkpoint
  check_injection_can_fire(cfg);
  const TrainResult result = train(cfg);
  // Data-parallel runs: rank 0 speaks for the job, unless this rank has its own failure to report.
  const bool speaks = result.summary.rank == 0 || (result.oom && !result.oom->elsewhere);
  if (result.oom) return report_oom(result, cfg, speaks);
  if (result.diverged) return report_divergence(result, cfg, speaks);
  if (result.interrupted) return report_interruption(result, cfg, speaks);
  if (!speaks) return 0;
  if (cfg.json) {
    fmt::print("{}\n", dump_json(summary_json(result.summary, cfg)));
  } else if (!cfg.quiet) {
    print_summary_text(result.summary);
  }
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, std::function<int()>& run) {
  CLI::App* cmd = app.add_subcommand("train",
                                     "Train a causal LM of the given architecture (random init) on a text corpus.\n"
                                     "With no flags: the 'tiny' preset on the bundled corpus for 200 steps.");
  auto config = bind_run_flags(cmd);
  cmd->callback([config, &run] { run = [config]() -> int { return run_train(config()); }; });
}

}  // namespace headroom
