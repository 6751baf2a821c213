#include "cli/doctor_command.h"

#include <fmt/format.h>

#include <cstdio>
#include <memory>

#include "cli/run_flags.h"
#include "device/device.h"
#include "doctor/doctor.h"
#include "doctor/report_html.h"
#include "util/atomic_file.h"
#include "util/error.h"
#include "util/interrupt.h"
#include "util/json.h"

namespace headroom {

void add_doctor_command(CLI::App& app, std::function<int()>& run) {
  CLI::App* cmd = app.add_subcommand(
      "doctor",
      "Diagnose a configuration: run it under its budget, explain what happened (OOM, breakdown measured vs\n"
      "estimated, leaks, fragmentation), predict each lever and run those that decide (--thorough: all),\n"
      "and recommend a plan proven to fit.\n"
      "Flags override an embedded default (tiny on the bundled corpus, cpu, batch 16 x seq 128 in 140 MiB,\n"
      "which does not fit); with none it runs that, in seconds on two cores. Exit code 3 when no plan\n"
      "fits or the recommended one fails its 2 verification steps.");
  auto config =
      bind_run_flags(cmd,
                     {"model", "set", "data", "data-tokens", "batch", "accum", "seq", "seed", "device", "attention", "moe-routing", "finetune", "base-weights", "offload", "loss", "precision",
                      "checkpointing", "optimizer", "memory-budget", "allocator", "allocator-conf", "inject-leak",
                      "threads", "json", "quiet"},
                     doctor_default());
  auto report = std::make_shared<std::string>();
  cmd->add_option("--report", *report, "also write a self-contained HTML report (charts as inline SVG) to FILE");
  auto thorough = std::make_shared<bool>(false);
  cmd->add_flag("--thorough", *thorough,
                "run every lever for real (on cpu the estimator predicts them, and only those near the budget are "
                "run)");
  cmd->callback([config, report, thorough, &run] {
    run = [config, report, thorough]() -> int {
      RunConfig cfg = config();
      validate(cfg);
      install_interrupt_handlers();  // Ctrl-C stops after the trial in flight
      if (!report->empty() && resolve_device(cfg.device).is_cuda()) cfg.memory_snapshot = *report + ".snapshot.pickle";
      const int64_t budget = device_budget(cfg, "doctor");
      // The report's path is tried first: a bad one fails before a minute of diagnosis, not after;
      // and a diagnosis that fails leaves no empty page behind.
      struct PendingReport {
        std::string path;
        bool written = false;
        ~PendingReport() {
          if (!path.empty() && !written) std::remove(path.c_str());
        }
      } pending;
      if (!report->empty()) {
        std::FILE* probe = std::fopen(report->c_str(), "w");
        if (probe == nullptr) fail("--report: cannot write '{}'", *report);
        std::fclose(probe);
        pending.path = *report;
      }
      const DoctorReport r = run_doctor(
          cfg, budget,
          [&](const std::string& line) {
            if (!cfg.quiet) fmt::print(stderr, "doctor: {}\n", line);
          },
          *thorough);
      if (!pending.path.empty()) {
        write_file_atomically(pending.path, report_html(r), "--report");
        pending.written = true;
        if (!cfg.quiet) fmt::print(stderr, "doctor: report written to {}\n", pending.path);
        if (!cfg.quiet && !r.snapshot.empty()) {
          fmt::print(stderr, "doctor: PyTorch memory snapshot written to {} (headroom analyze {} diagnoses it)\n",
                     r.snapshot, r.snapshot);
        }
      }
      if (cfg.json) {
        fmt::print("{}\n", dump_json(r.to_json()));
      } else {
        fmt::print("\n{}", r.to_text());
      }
      return r.plan_found && r.plan_verified ? 0 : kExitOom;
    };
  });
}

}  // namespace headroom
