#include "doctor/trials.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "device/cuda_adapter.h"
#include "device/device.h"
#include "dist/local_ranks.h"
#include "memory/allocator_config.h"
#include "train/observers.h"
#include "train/run.h"
#include "train/static_graph.h"
#include "train/step.h"
#include "util/error.h"
#include "util/files.h"
#include "util/interrupt.h"
#include "util/size.h"

namespace headroom {

// `capped`: under the budget (an OOM ends it early, its figures a lower bound); otherwise on the
// machine's own memory (cpu), so that the peak is the whole step's.
TrialRun run_trial(const RunConfig& config, int64_t steps, bool capped, const std::string& snapshot) {
  RunConfig c = as_trial(config, steps);
  if (!capped) c.memory_budget.reset();
  c.memory_snapshot = snapshot;
  TrialRun t;
  t.result = train(c);
  throw_if_interrupted("during the doctor's trials");
  t.fits = t.result.fits();
  t.peak = t.result.peak_or_failure_bytes();
  if (t.result.oom) t.oom = *t.result.oom;
  if (!t.result.steps.empty()) t.first_step_seconds = t.result.steps.front().seconds;
  for (const StepRecord& rec : t.result.steps) {
    for (Phase p : kStepPhases) {
      const PhaseMemory& m = rec.memory.phases[static_cast<size_t>(p) - 1];
      if (!m.seen) continue;
      t.timeline.push_back({rec.step, std::string(phase_name(p)), m.live_in, m.peak, m.live_out});
      if (p == rec.memory.peak_phase) t.breakdown = m.at_peak;
    }
  }
  return t;
}

// Lever 10 with a caching allocator (cuda, cpu caching), inside one run: two steps warm the cache,
// empty_cache() returns what it can, and a third step shows what that cost: the blocks it reserves
// again and its time against the warm step's.
LeverTrial empty_cache_trial(const RunConfig& reference, int64_t budget) {
  LeverTrial l{"empty-cache", "empty_cache()", true, false, 0, 0, 0, ""};
  MadeRun made = make_run(as_trial(reference, 3));
  if (!made.run) {
    l.applies = false;
    l.note = "not measured: the weights and optimizer state do not fit the budget";
    return l;
  }
  Run& run = *made.run;
  run.monitor->set_enabled(false);  // the allocator's own statistics measure it
  using Clock = std::chrono::steady_clock;
  auto sync = [&] {
    if (run.device.is_cuda()) cuda_synchronize(run.device.index());
  };
  auto step = [&](int64_t i) {
    sync();
    const auto t0 = Clock::now();
    StepOutcome out;
    run_step(run, StepShape{i, reference.batch * reference.accum, reference.batch}, out);
    sync();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  try {
    step(0);
    const double warm = step(1);
    const AllocatorState before = *run.probe->allocator_state();
    const auto t0 = Clock::now();
    run.probe->empty_cache();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const AllocatorState after = *run.probe->allocator_state();
    run.probe->reset_peak();
    const double cold = step(2);
    const AllocatorState end = *run.probe->allocator_state();
    l.fits = end.peak_reserved <= budget;
    l.peak_bytes = end.peak_reserved;
    l.saving_bytes = before.reserved - after.reserved;
    l.step_time_ratio = cold / warm;
    l.note = fmt::format(
        "returned {} of {} reserved in {:.1f} ms ({} still allocated); the step after it reserved up to {} again "
        "(the peak shown is reserved bytes); it lowers what the process holds between steps, not the step's peak",
        format_bytes(before.reserved - after.reserved), format_bytes(before.reserved), 1e3 * seconds,
        format_bytes(after.allocated), format_bytes(end.peak_reserved));
  } catch (const c10::OutOfMemoryError& e) {
    l.note = "not measured: out of memory: " + first_line(e.what_without_backtrace());
  }
  return l;
}

// A caching allocator setting tried as a lever (lever 10): the configuration's step with it, its
// peak reserved bytes against the configuration's own.
LeverTrial allocator_setting_trial(const RunConfig& reference, const std::string& setting, int64_t reference_reserved,
                                   int64_t budget, double reference_seconds) {
  LeverTrial l{"allocator", setting, true, false, 0, 0, 0, ""};
  // On top of the configuration's own settings (the flag's, else the environment's).
  const std::string own = reference.allocator_conf.empty() ? allocator_config_from_environment() : reference.allocator_conf;
  RunConfig c = reference;
  c.allocator_conf = own.empty() ? setting : own + "," + setting;
  const TrialRun t = run_trial(c, 2);
  if (resolve_device(reference.device).is_cuda()) {
    // Process-wide on cuda: back to the configuration's own settings for what follows.
    cuda_set_allocator_settings(own.empty() ? "expandable_segments:False" : own);
  }
  const int64_t reserved = t.result.summary.peak_reserved_bytes.value_or(t.peak);
  l.fits = t.fits && reserved <= budget;
  l.peak_bytes = reserved;
  l.saving_bytes = reference_reserved > 0 ? reference_reserved - reserved : 0;
  l.step_time_ratio = t.fits && reference_seconds > 0 ? t.first_step_seconds / reference_seconds : 0;
  l.note = t.fits ? fmt::format("peak reserved {} against {} without it (the peak shown is reserved bytes)",
                                format_bytes(reserved), format_bytes(reference_reserved))
                  : fmt::format("out of memory: {}", t.oom.message);
  return l;
}

// Lever 7 on cuda: the step eager and as a replayed CUDA graph (train/static_graph.h).
LeverTrial static_graph_trial(const RunConfig& reference, int64_t budget) {
  LeverTrial l{"static graph", "CUDA graph of fwd+bwd", true, false, 0, 0, 0, ""};
  constexpr int64_t kSteps = 4;
  RunConfig c = as_trial(reference, kSteps);
  c.memory_budget.reset();  // the card's own memory: both peaks are real ones, compared with the budget
  try {
    const StaticGraphTrial t = measure_static_graph(c, kSteps);
    if (!t.captured) {
      l.applies = false;
      l.note = fmt::format("{} (eager: {:.2f} ms per step, peak reserved {})", t.failure, 1e3 * t.eager_step_seconds,
                           format_bytes(t.eager_peak_reserved));
      return l;
    }
    l.peak_bytes = t.graphed_peak_reserved;
    l.saving_bytes = t.eager_peak_reserved - t.graphed_peak_reserved;
    l.fits = t.graphed_peak_reserved <= budget;
    l.step_time_ratio = t.graphed_step_seconds / t.eager_step_seconds;
    l.note = fmt::format(
        "peak and saving are reserved bytes against eager's {} (the graph's pool keeps its intermediates); "
        "{:.2f} ms per step replayed vs {:.2f} ms eager; first loss {:.4f} replayed, {:.4f} eager",
        format_bytes(t.eager_peak_reserved), 1e3 * t.graphed_step_seconds, 1e3 * t.eager_step_seconds,
        t.graphed_first_loss, t.eager_first_loss);
  } catch (const c10::OutOfMemoryError& e) {
    l.applies = false;
    l.note = "not measured: the eager step ran out of the card's memory: " + first_line(e.what_without_backtrace());
  } catch (const Error& e) {
    l.applies = false;
    l.note = std::string("not measured: ") + e.what();
  } catch (const c10::Error& e) {
    l.applies = false;
    l.note = "not measured: " + first_line(e.what_without_backtrace());
  }
  return l;
}


std::vector<std::string> local_rank_args(const RunConfig& config, bool cuda, int64_t budget, const std::string& metrics) {
  RunConfig t = as_trial(config, 2);
  t.device = cuda ? "cuda" : "cpu";
  t.memory_budget = budget;
  t.json = true;
  t.metrics = metrics;
  if (!cuda) t.threads = 1;  // the ranks share the cores: one thread each on cpu
  std::vector<std::string> args = {"train"};
  for (std::string& a : run_args(t)) args.push_back(std::move(a));
  return args;
}

LeverTrial data_parallel_trial(const RunConfig& c, int ranks, bool cuda, int64_t budget, int64_t measured_peak,
                               double reference_seconds) {
  const std::string metrics = (std::filesystem::temp_directory_path() /
                               fmt::format("headroom-doctor-{}-{}.jsonl", ::getpid(), shard_level_name(c.shard)))
                                  .string();
  const LocalRanksResult res = run_local_ranks(ranks, local_rank_args(c, cuda, budget, metrics));
  throw_if_interrupted("during the doctor's trials");
  LeverTrial lt{"data parallel", fmt::format("{} ranks, --shard {}", ranks, shard_level_name(c.shard)), true, false,
                0, 0, 0, fmt::format("micro-batch {} x accum {} on each rank; peak per rank", c.batch, c.accum)};
  const auto summary = nlohmann::json::parse(last_line(res.rank0_stdout), nullptr, false);
  if (res.ok() && summary.is_object() && summary.contains("rank_peak_bytes")) {
    lt.fits = true;
    for (const int64_t p : summary.at("rank_peak_bytes").get<std::vector<int64_t>>()) {
      lt.peak_bytes = std::max(lt.peak_bytes, p);
    }
    std::ifstream lines(metrics);
    std::string first;
    if (std::getline(lines, first) && reference_seconds > 0) {
      const auto j = nlohmann::json::parse(first, nullptr, false);
      if (j.is_object() && j.contains("seconds")) lt.step_time_ratio = j.at("seconds").get<double>() / reference_seconds;
    }
  } else if (summary.is_object() && summary.contains("oom")) {
    const auto& oom = summary.at("oom");
    lt.peak_bytes = oom.value("in_use_bytes", int64_t{0}) + std::max<int64_t>(0, oom.value("requested_bytes", int64_t{0}));
    lt.note += fmt::format("; out of memory on rank {}", oom.value("rank", nlohmann::json(0)).dump());
  } else {
    lt.applies = false;
    lt.note = "not run: " + (res.first_error.empty() ? std::string("no result from rank 0") : res.first_error);
    return lt;
  }
  lt.saving_bytes = measured_peak - lt.peak_bytes;
  std::error_code ec;
  std::filesystem::remove(metrics, ec);
  for (int r = 1; r < ranks; ++r) std::filesystem::remove(rank_file(metrics, r), ec);
  return lt;
}

}  // namespace headroom
