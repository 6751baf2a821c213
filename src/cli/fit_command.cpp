#include "cli/fit_command.h"

#include <fmt/format.h>

#include <cstdio>

#include "cli/run_flags.h"
#include "device/cuda_adapter.h"
#include "device/device.h"
#include "estimate/estimator.h"
#include "train/batch_search.h"
#include "util/error.h"
#include "util/interrupt.h"
#include "util/json.h"
#include "util/size.h"

namespace headroom {

void add_fit_command(CLI::App& app, std::function<int()>& run) {
  CLI::App* cmd = app.add_subcommand(
      "fit",
      "Find the largest micro-batch that fits the memory budget, with real trial steps: the estimator\n"
      "predicts it, a trial verifies it and the next batch, a wrong prediction is corrected by what\n"
      "the trial measured, and bisection is the fallback.\n"
      "Exit code 3 (with max_batch 0 in --json) when not even micro-batch 1 fits.");
  // What shapes a step's memory; schedule and output flags of `train` do not apply.
  auto config = bind_run_flags(cmd, {"model", "set", "data", "data-tokens", "seq", "seed", "device", "attention", "moe-routing", "finetune", "base-weights", "offload", "loss", "precision",
                                     "checkpointing", "optimizer", "memory-budget", "threads", "json", "quiet"});
  auto limit = std::make_shared<int64_t>(1024);
  cmd->add_option("--max-batch", *limit, "largest micro-batch to consider")->check(CLI::Range(1, 1 << 20));
  cmd->callback([config, limit, &run] {
    run = [config, limit]() -> int {
      const RunConfig cfg = config();
      validate(cfg);
      install_interrupt_handlers();  // Ctrl-C stops after the trial in flight
      const int64_t budget = device_budget(cfg, "fit");
      if (!cfg.quiet) {
        fmt::print(stderr, "headroom fit: {} at --seq {} within {}, micro-batches 1..{}\n", cfg.model, cfg.seq,
                   format_bytes(budget), *limit);
      }
      const FitResult r = search_max_batch(
          [&](int64_t batch) {
            const Trial t = trial_step(cfg, batch);
            if (!cfg.quiet) {
              fmt::print(stderr, "  trial batch {:>5}: {:<8} peak {}\n", batch, t.fits ? "fits" : "OOM",
                         format_bytes(t.peak_bytes));
            }
            return t;
          },
          budget, *limit, peak_predictor(cfg));
      if (cfg.json) fmt::print("{}\n", dump_json(r.to_json()));
      if (r.max_batch == 0) {
        if (!cfg.quiet) {
          fmt::print(stderr,
                     "no micro-batch fits in {}: `headroom train --batch 1 --memory-budget {}` shows what "
                     "holds the memory and which levers would help\n",
                     format_bytes(budget), format_bytes(budget));
        }
        return kExitOom;
      }
      if (!cfg.json) {
        fmt::print(stderr, "largest micro-batch that fits: {} ({} trials)\n", r.max_batch, r.log.size());
      }
      return 0;
    };
  });
}

}  // namespace headroom
