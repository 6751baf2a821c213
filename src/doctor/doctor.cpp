#include "doctor/doctor.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <limits>
#include <map>

#include "device/cuda_adapter.h"
#include "dist/local_ranks.h"
#include "train/observers.h"
#include "device/device.h"
#include "memory/allocator_config.h"
#include "memory/oom_report.h"
#include "plan/cost_model.h"
#include "plan/levers.h"
#include "plan/oom_advice.h"
#include "train/static_graph.h"
#include "train/step.h"
#include "train/step_timing.h"
#include "train/trainer.h"
#include "util/error.h"
#include "util/files.h"
#include "util/interrupt.h"
#include "util/size.h"

namespace headroom {
namespace {

struct TrialRun {
  bool fits = false;
  int64_t peak = 0;
  double first_step_seconds = 0;
  OomReport oom;
  Breakdown breakdown;  // at the last step's peak (fitted runs)
  TrainResult result;
  std::vector<PhasePoint> timeline;
};

// `capped`: under the budget (an OOM ends it early, its figures a lower bound); otherwise on the
// machine's own memory (cpu), so that the peak is the whole step's.
TrialRun run_trial(const RunConfig& config, int64_t steps, bool capped = true, const std::string& snapshot = "") {
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

std::string describe_run(const RunConfig& c) { return plan_of(c).describe(); }

// The largest micro-batch (at most the configured one) the estimator says fits, keeping the
// global batch; 0 when none.
int64_t largest_fitting_micro(const ModelConfig& model, const RunConfig& cfg, int64_t budget) {
  const int64_t global = cfg.batch * cfg.accum;
  for (int64_t m = cfg.batch; m >= 1; --m) {
    if (global % m != 0) continue;  // the same sequences per step, exactly
    RunConfig c = cfg;
    c.batch = m;
    c.accum = global / m;
    if (static_cast<double>(estimate(model, train_spec(c)).peak_bytes) <= 0.95 * static_cast<double>(budget)) return m;
  }
  return 0;
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

}  // namespace

RunConfig doctor_default() {
  RunConfig c;
  c.model = "tiny";
  c.device = "cpu";
  c.seq = 128;
  c.batch = 16;
  c.accum = 1;
  c.memory_budget = int64_t{140} << 20;
  return c;
}

namespace {

// The smallest peak any combination of levers reaches — every optimizer, pure bf16 too, no margin —
// and the combination.
std::pair<int64_t, std::string> smallest_peak(const PlanRequest& request) {
  PlanRequest any = request;
  any.allow_optimizer_change = true;
  any.margin = 0;
  const PlanResult mixed = fitting_plans(any);
  any.base.precision = Precision::bf16;
  const PlanResult pure = fitting_plans(any);
  if (pure.smallest_peak < mixed.smallest_peak) return {pure.smallest_peak, pure.smallest_peak_plan};
  return {mixed.smallest_peak, mixed.smallest_peak_plan};
}

// A step's predicted time relative to another's: the FLOPs of its micro-batches, times how much
// slower its precision's matmuls are (plan/cost_model.h's model without a calibration).
double predicted_time_ratio(const ModelConfig& model, const RunConfig& c, const RunConfig& reference) {
  auto work = [&](const RunConfig& x) {
    return static_cast<double>(x.accum) * micro_batch_flops(model, x.batch, x.seq, x.checkpointing, x.attention) *
           precision_slowdown(x.precision, x.device);
  };
  return work(c) / work(reference);
}

}  // namespace

namespace {

// One diagnosis, stage by stage (the header's order); what the stages learn is kept here.
class Diagnosis {
 public:
  Diagnosis(const RunConfig& given, int64_t budget, const std::function<void(const std::string&)>& progress,
            bool thorough)
      : given_(given),
        budget_(budget),
        progress_(progress),
        device_(resolve_device(given.device)),
        model_(load_model_config(given.model, given.overrides)),
        // On cpu the estimator is exact (estimator_test.cpp), so a lever's memory is predicted and
        // only what decides the answer is run; on cuda (fragmentation, workspaces) every lever is.
        predict_first_(!device_.is_cuda() && !thorough),
        // On cpu a trial can run beyond the budget, on the machine's memory.
        free_trials_(!device_.is_cuda()) {
    cfg_ = given;
    cfg_.memory_budget = budget;
    r_.config = cfg_;
    r_.budget = budget;
    r_.device = device_.str();
    request_.base = cfg_;
    request_.global_batch = cfg_.batch * cfg_.accum;
    request_.budget = budget;
  }

  DoctorReport run() {
    what_happened();
    if (!nothing_can_fit()) {
      measure_whole_step();
      predict_levers();
      check_leaks();
      try_levers();
      data_parallel_levers();
      cuda_levers();
      recommend();
    }
    r_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    return r_;
  }

 private:
  // A lever's prediction, and whether it is run for real.
  struct Row {
    const LeverChange* change;
    RunConfig config;
    int64_t predicted_peak;
    double predicted_ratio;
    bool run, slow;
  };

  void say(const std::string& s) const {
    if (!progress_) return;
    progress_(reference_seconds_ > 0 && pending_steps_ > 0
                  ? fmt::format("{} (about {} left)", s, format_duration(pending_steps_ * reference_seconds_))
                  : s);
  }

  // (1) The configuration as given, under its budget, with the guard off.
  void what_happened() {
    say(fmt::format("1/5 running the configuration as given: {}, 3 steps under {}", describe_run(cfg_),
                    format_bytes(budget_)));
    base_ = run_trial(cfg_, 3);
    r_.oom = !base_.fits;
    r_.measured_peak = base_.peak;
    r_.measured = base_.breakdown;
    if (r_.oom) {
      r_.oom_phase = std::string(phase_name(base_.oom.phase));
      r_.oom_step = base_.oom.step;
      OomReport report = base_.oom;
      report.advice = oom_advice(report, as_trial(cfg_, 3));
      r_.oom_text = report.to_text();
      r_.measured = base_.oom.breakdown;
      // With a caching allocator the live bytes and the request may have fit: the segments did not.
      fragmentation_oom_ = caching_ && !base_.oom.injected && base_.oom.requested > 0 &&
                           base_.oom.in_use + base_.oom.requested <= budget_;
    } else if (!base_.result.steps.empty()) {
      reference_seconds_ = base_.first_step_seconds;  // a first step, as each lever trial's is
      r_.measured_whole_step = true;
      r_.reference = "the configuration as given";
    }
    r_.estimate = estimate(model_, train_spec(cfg_));
  }

  // Nothing any lever reaches fits — any optimizer, pure bf16, no margin: no trial can change that,
  // so none is run.
  bool nothing_can_fit() {
    const auto [smallest, how] = smallest_peak(request_);
    if (!r_.oom || smallest <= budget_) return false;
    r_.plan_note = fmt::format(
        "nothing can fit {}: the smallest peak any combination of levers reaches (other optimizers and pure bf16 "
        "included) is {} ({}), by the estimator; a larger budget, a shorter --seq or a smaller model is needed",
        format_bytes(budget_), format_bytes(smallest), how);
    r_.leak.reason = "not run: no configuration fits the budget";
    r_.fragmentation = "not measured: no configuration fits the budget";
    return true;
  }

  // On cpu, a step that ran out is measured whole on the machine's memory: every peak below is a
  // real one, compared with the budget, not a failure's lower bound.
  void measure_whole_step() {
    if (!free_trials_ || !r_.oom) return;
    say("1/5 measuring the whole step as given, on the machine's memory");
    const TrialRun whole = run_trial(cfg_, 1, false);
    if (!whole.fits) return;
    r_.measured_peak = whole.peak;
    r_.measured = whole.breakdown;
    r_.measured_whole_step = true;
    reference_seconds_ = whole.first_step_seconds;
    r_.reference = "the configuration as given";
  }

  // (3-8) Each lever, predicted by the estimator; run for real where the prediction is close
  // enough to the budget to decide whether it fits (every one with --thorough, and on cuda). A
  // precision whose matmuls this device emulates is not run: a step would take many times the
  // reference, and its memory is what the estimator says.
  void predict_levers() {
    changes_ = lever_changes(cfg_, model_.num_layers);
    for (const LeverChange& ch : changes_) {
      RunConfig c = cfg_;
      ch.apply(c);
      const int64_t peak = estimate(model_, train_spec(c)).peak_bytes;
      const bool slow = precision_slowdown(c.precision, c.device) > 4;
      const bool near = std::abs(static_cast<double>(peak - budget_)) <= 0.15 * static_cast<double>(budget_);
      rows_.push_back({&ch, c, peak, predicted_time_ratio(model_, c, cfg_), !slow && (!predict_first_ || near), slow});
    }
  }

  // (2) Leaks, at a micro-batch that fits, one micro-batch per step: growth from step to step does
  // not depend on how a global batch is split, and each step costs a micro-batch, not a global one.
  void check_leaks() {
    reference_ = cfg_;
    if (r_.oom) reference_.batch = std::max<int64_t>(1, largest_fitting_micro(model_, cfg_, budget_));
    RunConfig leak_config = reference_;
    leak_config.accum = 1;
    leak_config.leak_origins = true;  // cuda: the allocator tags each allocation with its step and phase
    const double leak_step = reference_seconds_ > 0 ? predicted_time_ratio(model_, leak_config, cfg_) : 0;
    const int64_t leak_steps = leak_step > 0 && 12 * leak_step * reference_seconds_ > 20 ? 8 : 12;
    r_.leak_run = fmt::format("{}, {} steps", describe_run(leak_config), leak_steps);
    // Time left, in steps of the configuration as given: the leak check, the levers that run, the
    // calibration (4 steps at micro-batches 1 and 4) and the verification (2 steps).
    RunConfig one = cfg_, four = cfg_;
    one.batch = one.accum = 1;
    four.batch = std::min<int64_t>(4, request_.global_batch);
    four.accum = 1;
    pending_steps_ = static_cast<double>(leak_steps) * leak_step + 4 * predicted_time_ratio(model_, one, cfg_) +
                     4 * predicted_time_ratio(model_, four, cfg_) + 2;
    for (const Row& row : rows_) pending_steps_ += row.run ? row.predicted_ratio : 0;
    say("2/5 leak check: " + r_.leak_run);
    const TrialRun leak_trial = run_trial(leak_config, leak_steps, !free_trials_);
    pending_steps_ = std::max(0.0, pending_steps_ - static_cast<double>(leak_steps) * leak_step);
    r_.leak = judge_growth(leak_trial.result.live_series());
    if (!leak_trial.fits) {
      r_.leak.reason += fmt::format("; the run ran out of memory in step {} of {}{}", leak_trial.oom.step, leak_steps,
                                    r_.leak.detected ? ", as the growth predicts" : "");
    } else {
      if (r_.leak.detected) r_.leak.sites = leak_trial.result.summary.surviving;
      if (reference_seconds_ == 0 && !leak_trial.result.steps.empty()) {
        reference_seconds_ = leak_trial.result.median_step_seconds() / predicted_time_ratio(model_, leak_config, cfg_);
        r_.reference = "the configuration as given (from the leak check's steps)";
      }
    }
    const auto with_reserved = std::find_if(leak_trial.result.steps.rbegin(), leak_trial.result.steps.rend(),
                                            [](const StepRecord& rec) { return rec.peak_reserved_bytes.has_value(); });
    if (with_reserved != leak_trial.result.steps.rend()) {
      const StepRecord& rec = *with_reserved;
      reference_reserved_ = *rec.peak_reserved_bytes;
      r_.fragmentation = fmt::format(
          "step {}: peak reserved {} vs peak allocated {}: {} held by the caching allocator beyond the live "
          "bytes, up to {} of it free inside split segments (inactive split)",
          rec.step, format_bytes(*rec.peak_reserved_bytes), format_bytes(rec.peak_bytes),
          format_bytes(*rec.peak_reserved_bytes - rec.peak_bytes), format_bytes(rec.peak_inactive_split_bytes.value_or(0)));
    } else if (!caching_) {
      r_.fragmentation =
          "not measured: cpu's counting allocator hands memory straight back, there is no cache to fragment "
          "(--allocator caching reproduces the CUDA caching allocator and measures it)";
    }
  }

  void try_levers() {
    const auto to_run = std::count_if(rows_.begin(), rows_.end(), [](const Row& x) { return x.run; });
    int index = 0;
    for (const Row& row : rows_) {
      const LeverChange& ch = *row.change;
      LeverTrial lt;
      lt.lever = lever_name(ch.lever);
      lt.setting = ch.setting;
      lt.note = ch.note;
      if (!row.run) {
        lt.measured = false;
        lt.peak_bytes = row.predicted_peak;
        lt.fits = row.predicted_peak <= budget_;
        lt.saving_bytes = r_.estimate.peak_bytes - row.predicted_peak;
        lt.step_time_ratio = row.predicted_ratio;
        if (row.slow) {
          lt.note += fmt::format("; not run: this device's {} matmuls are {:.0f}x slower than float32's (emulated)",
                                 precision_name(row.config.precision),
                                 precision_slowdown(row.config.precision, row.config.device));
        }
        r_.levers.push_back(lt);
        continue;
      }
      say(fmt::format("3/5 lever {}/{}: {} {}", ++index, to_run, lever_name(ch.lever), ch.setting));
      const TrialRun t = run_trial(row.config, 1, !free_trials_);
      pending_steps_ = std::max(0.0, pending_steps_ - row.predicted_ratio);
      lt.fits = t.fits && t.peak <= budget_;
      lt.peak_bytes = t.peak;
      lt.saving_bytes = r_.measured_peak - t.peak;
      lt.step_time_ratio = t.fits && reference_seconds_ > 0 ? t.first_step_seconds / reference_seconds_ : 0;
      if (!t.fits) lt.note += "; out of memory (peak: in use at the failure plus the request)";
      if (ch.lever == Lever::precision && t.fits && lt.step_time_ratio > 0) {
        precision_ratio_[row.config.precision] = lt.step_time_ratio;
      }
      r_.levers.push_back(lt);
    }
    if (r_.measured_whole_step && index > 0) {
      // The first steps of a process run slower (the allocator and the kernels warm up): the
      // configuration's own step is timed again after the levers, and the faster time is the reference.
      const TrialRun again = run_trial(cfg_, 1, !free_trials_);
      if (again.fits && again.first_step_seconds < reference_seconds_) {
        const double scale = reference_seconds_ / again.first_step_seconds;
        reference_seconds_ = again.first_step_seconds;
        for (LeverTrial& l : r_.levers) {
          if (l.measured) l.step_time_ratio *= scale;
        }
        for (auto& [p, ratio] : precision_ratio_) ratio *= scale;
      }
    }
  }

  // Lever 6: the configuration on 2 local ranks (this binary started twice, rank 0 hosting the
  // store), the global batch split between them, for each shard level: 2 steps under the budget,
  // each rank's peak against the configuration's own. On cuda it needs a card per rank.
  void data_parallel_levers() {
    constexpr int kRanks = 2;
    const std::string lever = "data parallel";
    if (device_.is_cuda() && cuda_device_count() < kRanks) {
      r_.levers.push_back({lever, "2 ranks", false, false, 0, 0, 0,
                           fmt::format("not run: {} CUDA device here, lever 6 needs one per rank (estimate "
                                       "--world-size N --shard S predicts a rank's peak)",
                                       cuda_device_count())});
      return;
    }
    RunConfig c = cfg_;
    if (c.batch % kRanks == 0) {
      c.batch /= kRanks;
    } else if (c.accum % kRanks == 0) {
      c.accum /= kRanks;
    } else {
      r_.levers.push_back({lever, "2 ranks", false, false, 0, 0, 0,
                           fmt::format("not run: the global batch {} x {} does not split evenly over 2 ranks",
                                       cfg_.batch, cfg_.accum)});
      return;
    }
    for (ShardLevel level : shard_settings(kRanks)) {
      c.shard = level;
      const std::string setting = fmt::format("2 ranks, --shard {}", shard_level_name(level));
      say("3/5 lever: data parallel, " + setting + " (this binary started twice)");
      const std::string metrics = (std::filesystem::temp_directory_path() /
                                   fmt::format("headroom-doctor-{}-{}.jsonl", ::getpid(), shard_level_name(level)))
                                      .string();
      LocalRanksResult res;
      try {
        res = run_local_ranks(kRanks, trial_args(c, metrics));
      } catch (const Error& e) {
        r_.levers.push_back({lever, setting, false, false, 0, 0, 0, std::string("not run: ") + e.what()});
        return;
      }
      throw_if_interrupted("during the doctor's trials");
      LeverTrial lt{lever, setting, true, false, 0, 0, 0,
                    fmt::format("micro-batch {} x accum {} on each rank; peak per rank", c.batch, c.accum)};
      const auto summary = nlohmann::json::parse(last_line(res.rank0_stdout), nullptr, false);
      if (res.ok() && summary.is_object() && summary.contains("rank_peak_bytes")) {
        lt.fits = true;
        for (const int64_t p : summary.at("rank_peak_bytes").get<std::vector<int64_t>>()) {
          lt.peak_bytes = std::max(lt.peak_bytes, p);
        }
        std::ifstream lines(metrics);
        std::string first;
        if (std::getline(lines, first) && reference_seconds_ > 0) {
          const auto j = nlohmann::json::parse(first, nullptr, false);
          if (j.is_object() && j.contains("seconds")) lt.step_time_ratio = j.at("seconds").get<double>() / reference_seconds_;
        }
      } else if (summary.is_object() && summary.contains("oom")) {
        const auto& oom = summary.at("oom");
        lt.peak_bytes = oom.value("in_use_bytes", int64_t{0}) + std::max<int64_t>(0, oom.value("requested_bytes", int64_t{0}));
        lt.note += fmt::format("; out of memory on rank {}", oom.value("rank", nlohmann::json(0)).dump());
      } else {
        lt.applies = false;
        lt.note = "not run: " + (res.first_error.empty() ? std::string("no result from rank 0") : res.first_error);
        r_.levers.push_back(lt);
        continue;
      }
      lt.saving_bytes = r_.measured_peak - lt.peak_bytes;
      r_.levers.push_back(lt);
      std::error_code ec;
      std::filesystem::remove(metrics, ec);
      std::filesystem::remove(rank_file(metrics, 1), ec);
    }
  }

  // `c` as the command line of a 2-step trial of it, with its metrics at `metrics`.
  std::vector<std::string> trial_args(const RunConfig& c, const std::string& metrics) const {
    std::vector<std::string> a = {"train", "--model", c.model};
    for (const auto& o : c.overrides) a.insert(a.end(), {"--set", o});
    if (!c.data.empty()) a.insert(a.end(), {"--data", c.data});
    a.insert(a.end(), {"--device", device_.is_cuda() ? "cuda" : "cpu", "--seed", std::to_string(c.seed), "--seq",
                       std::to_string(c.seq), "--batch", std::to_string(c.batch), "--accum", std::to_string(c.accum),
                       "--precision", precision_name(c.precision), "--checkpointing", c.checkpointing.name(),
                       "--attention", attention_path_name(c.attention), "--optimizer", optimizer_name(c.optimizer),
                       "--allocator", allocator_kind_name(c.allocator), "--memory-budget",
                       std::to_string(budget_), "--shard", shard_level_name(c.shard), "--steps", "2", "--eval-rows",
                       "0", "--no-guard", "--quiet", "--json", "--metrics", metrics});
    if (!c.allocator_conf.empty()) a.insert(a.end(), {"--allocator-conf", c.allocator_conf});
    // Two ranks share the cores: one thread each on cpu.
    if (!device_.is_cuda()) a.insert(a.end(), {"--threads", "1"});
    return a;
  }

  // Levers 10 and 7: lever 10 measured with a caching allocator (cuda, cpu caching), lever 7 on cuda.
  void cuda_levers() {
    const std::string at_reference =
        reference_.batch == cfg_.batch ? "" : fmt::format(" (at the leak check's micro-batch {})", reference_.batch);
    if (!caching_) {
      r_.levers.push_back({"empty-cache", "empty_cache()", false, false, 0, 0, 0,
                           "not measured: cpu's counting allocator keeps no cache (--allocator caching does)"});
    } else {
      say("3/5 lever: empty-cache, two steps on a warm cache, then one after emptying it");
      LeverTrial empty = empty_cache_trial(reference_, budget_);
      empty.note += at_reference;
      r_.levers.push_back(empty);
      const AllocatorConfig own = parse_allocator_config(
          cfg_.allocator_conf.empty() ? allocator_config_from_environment() : cfg_.allocator_conf, "allocator settings");
      std::vector<std::string> settings;
      if (!own.expandable_segments) settings.push_back("expandable_segments:True");
      // Fragmentation ended the configuration: oversize blocks kept whole is the other setting for it.
      if (fragmentation_oom_ && own.max_split_size == std::numeric_limits<int64_t>::max()) {
        settings.push_back("max_split_size_mb:128");
      }
      for (const std::string& setting : settings) {
        say("3/5 lever: allocator " + setting);
        LeverTrial t = allocator_setting_trial(reference_, setting, reference_reserved_, budget_, reference_seconds_);
        t.note += at_reference;
        r_.levers.push_back(t);
      }
    }
    if (!device_.is_cuda()) {
      r_.levers.push_back({"static graph", "CUDA graphs", false, false, 0, 0, 0,
                           "does not apply on cpu: CUDA graphs capture GPU kernel launches"});
      return;
    }
    say("3/5 lever: static graph, eager steps then the step captured as a CUDA graph and replayed");
    LeverTrial graphed = static_graph_trial(reference_, budget_);
    graphed.note += at_reference;
    r_.levers.push_back(graphed);
  }

  // The recommendation, and its proof. The cost model is calibrated in the configuration's own
  // precision; the others are scaled by what their trials (or their matmuls) measured. When the
  // configuration fits as given, what is recommended keeps its numerics (precision and
  // optimizer); faster plans that change them are options, not a fix.
  void recommend() {
    const PlanResult candidates = fitting_plans(request_);
    for (Precision p : precisions_of(candidates)) {
      // Precisions not timed by a trial: their matmul slowdown stands in for the step's.
      if (p != cfg_.precision && !precision_ratio_.count(p)) {
        precision_ratio_[p] = precision_slowdown(p, cfg_.device) / precision_slowdown(cfg_.precision, cfg_.device);
      }
    }
    say("4/5 planning: the estimator's candidates under the budget, ranked by a calibrated cost model");
    RunConfig timing = cfg_;
    timing.memory_budget.reset();
    const PlanResult plans = plan_with_calibration(
        request_, [&timing](Precision p, int64_t rows, int timed) { return time_train_step(timing, p, rows, timed); },
        precision_ratio_, [&](const std::string& line) { say("4/5 " + line); });
    pending_steps_ = 2;
    if (plans.plans.empty() && !r_.oom) {
      // It fits as given, closer to the budget than the planner's margin lets a plan be: the
      // configuration itself is the plan, verified by the run that began the diagnosis.
      r_.plan_found = r_.plan_verified = true;
      r_.plan = plan_of(cfg_);
      r_.plan.predicted_peak_bytes = r_.estimate.peak_bytes;
      r_.verified_peak_bytes = base_.peak;
      r_.timeline = base_.timeline;
      r_.plan_note =
          fmt::format("no other plan is predicted to fit within the planner's {:.0f}% margin", 100 * request_.margin);
      return;
    }
    if (plans.plans.empty()) {
      r_.plan_note = fmt::format("no plan fits: the smallest predicted peak is {} ({})",
                                 format_bytes(plans.smallest_peak), plans.smallest_peak_plan);
      return;
    }
    const Plan* chosen = &plans.plans.front();
    bool keeps_numerics = false;
    if (!r_.oom) {
      for (const Plan& p : plans.plans) {
        if (p.precision == cfg_.precision && p.optimizer == cfg_.optimizer) {
          chosen = &p;
          keeps_numerics = true;
          break;
        }
      }
      for (const Plan& p : plans.plans) {
        if ((p.precision != cfg_.precision || p.optimizer != cfg_.optimizer) && r_.options.size() < 3 &&
            p.predicted_step_seconds < chosen->predicted_step_seconds) {
          r_.options.push_back(p);
        }
      }
    }
    r_.plan_found = true;
    r_.plan = *chosen;
    pending_steps_ = 2 * predicted_time_ratio(model_, with_plan(cfg_, r_.plan), cfg_);
    say(fmt::format("5/5 training the recommended plan for 2 steps under {}", format_bytes(budget_)));
    // On cuda, PyTorch's memory snapshot of these steps goes next to the report.
    const TrialRun v = run_trial(with_plan(cfg_, r_.plan), 2, true, given_.memory_snapshot);
    if (!given_.memory_snapshot.empty() && v.fits) r_.snapshot = given_.memory_snapshot;
    r_.plan_verified = v.fits;
    r_.verified_peak_bytes = v.peak;
    r_.timeline = v.timeline;
    r_.plan_note = fmt::format("best of {} plans that fit ({} considered){}", plans.plans.size(), plans.considered,
                               keeps_numerics ? ", keeping the configuration's precision and optimizer" : "");
  }

  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  const RunConfig& given_;
  const int64_t budget_;
  const std::function<void(const std::string&)>& progress_;
  const at::Device device_;
  const bool caching_ = device_.is_cuda() || given_.allocator == AllocatorKind::caching;
  int64_t reference_reserved_ = 0;  // peak reserved of the leak check's last step (caching allocators)
  bool fragmentation_oom_ = false;  // the configuration ran out of segments, not of live bytes
  const ModelConfig model_;
  const bool predict_first_, free_trials_;
  RunConfig cfg_;        // as given, with the budget
  RunConfig reference_;  // at a micro-batch that fits (the leak check's, cuda's levers 7 and 10)
  PlanRequest request_;
  DoctorReport r_;
  TrialRun base_;                                // the configuration as given, under the budget
  double reference_seconds_ = 0;                 // a step of the configuration as given
  double pending_steps_ = 0;                     // time left, in reference steps
  std::vector<LeverChange> changes_;             // the lever table's changes (rows_ point into it)
  std::vector<Row> rows_;                        // each lever's prediction
  std::map<Precision, double> precision_ratio_;  // step time against the configuration's precision
};

}  // namespace

DoctorReport run_doctor(const RunConfig& given, int64_t budget, const std::function<void(const std::string&)>& progress,
                        bool thorough) {
  return Diagnosis(given, budget, progress, thorough).run();
}

nlohmann::json DoctorReport::to_json() const {
  nlohmann::json levers_json = nlohmann::json::array();
  for (const LeverTrial& l : levers) {
    levers_json.push_back(
        {{"lever", l.lever},
         {"setting", l.setting},
         {"applies", l.applies},
         {"peak_bytes", l.applies ? nlohmann::json(l.peak_bytes) : nlohmann::json()},
         {"saving_bytes", l.applies ? nlohmann::json(l.saving_bytes) : nlohmann::json()},
         {"step_time_ratio", l.applies && l.fits ? nlohmann::json(l.step_time_ratio) : nlohmann::json()},
         {"fits", l.fits},
         {"measured", l.applies && l.measured},
         {"note", l.note}});
  }
  nlohmann::json plan_json;
  if (plan_found) {
    plan_json = plan.to_json();
    plan_json["verified_peak_bytes"] = verified_peak_bytes;
    plan_json["verified"] = plan_verified;
  }
  nlohmann::json options_json = nlohmann::json::array();
  for (const Plan& p : options) options_json.push_back(p.to_json());
  return {{"model", {{"name", estimate.model}, {"params", estimate.params}}},
          {"device", device},
          {"budget_bytes", budget},
          {"oom",
           {{"happened", oom},
            {"phase", oom ? nlohmann::json(oom_phase) : nlohmann::json()},
            {"step", oom ? nlohmann::json(oom_step) : nlohmann::json()}}},
          {"measured", measured.to_json()},
          {"measured_peak_bytes", measured_peak},
          {"estimate", estimate.to_json()["breakdown"]},
          {"estimated_peak_bytes", estimate.peak_bytes},
          {"leak", leak.to_json()},
          {"fragmentation", fragmentation},
          {"levers", levers_json},
          {"fits_as_given", !oom},
          {"plan", plan_json},
          {"options", options_json},
          {"plan_note", plan_note},
          {"seconds", seconds}};
}

std::string DoctorReport::to_text() const {
  std::string out;
  out += fmt::format("headroom doctor: {} ({:.2f}M params) on {}, budget {}\n  as given: {}, seq {}\n\n",
                     estimate.model, static_cast<double>(estimate.params) / 1e6, device, format_bytes(budget),
                     describe_run(config), config.seq);
  out += "1. What happened\n";
  if (oom) {
    out += oom_step == 0 ? std::string("   OUT OF MEMORY before the first step:\n")
                         : fmt::format("   OUT OF MEMORY in {} of step {}:\n", oom_phase, oom_step);
    // The facts and every category of what was in use (the largest is what to act on).
    std::string text = oom_text;
    size_t pos = 0;
    for (int i = 0; i < 7 && pos < text.size(); ++i) {
      const size_t nl = text.find('\n', pos);
      out += "     " + text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos) + "\n";
      if (nl == std::string::npos) break;
      pos = nl + 1;
    }
  } else {
    out += fmt::format("   it fits: peak {} of {}\n", format_bytes(measured_peak), format_bytes(budget));
  }
  const int64_t est_act = estimate.step_memory();
  const bool partial = oom && !measured_whole_step;
  out += fmt::format("   {:<34} {:>11} {:>11}\n",
                     partial ? "at the failure / whole step"
                             : (measured_whole_step ? "whole step, without the budget:" : "at the step's peak:"),
                     "measured", "estimated");
  auto row = [&](const char* name, int64_t m, int64_t e) {
    out += fmt::format("   {:<34} {:>11} {:>11}\n", name, format_bytes(m), format_bytes(e));
  };
  row("weights", measured.weights, estimate.category(sim::Category::weights));
  row("gradients", measured.gradients, estimate.category(sim::Category::gradients));
  row("optimizer state", measured.optimizer, estimate.category(sim::Category::optimizer));
  row("activations, logits, loss, temps", measured.activations, est_act);
  row("other (data)", measured.other, estimate.category(sim::Category::other));
  row(partial ? "total" : "peak", measured_peak, estimate.peak_bytes);
  out += fmt::format("   the estimate's peak is in {}\n\n", phase_name(estimate.peak_phase));

  out += "2. Leaks and fragmentation\n";
  if (leak_run.empty()) {
    out += "   leak: not checked\n";
  } else {
    out += fmt::format("   leak: {} ({})\n", leak.detected ? "DETECTED" : "none", leak_run);
  }
  out += "     " + leak.reason + "\n";
  for (const LeakSite& s : leak.sites) out += "     - " + s.description + "\n";
  out += "   fragmentation: " + fragmentation + "\n\n";

  if (levers.empty()) {
    out += "3. Levers: not tried\n";
  } else {
    out += fmt::format(
        "3. Levers (step time relative to {}; \"run\": measured in a real step, \"est\": predicted by the "
        "estimator and the cost model)\n",
        reference.empty() ? "-" : reference);
  }
  if (!levers.empty()) {
    out += fmt::format("   {:<13} {:<26} {:>10} {:>10} {:>6} {:>5} {:>4}  {}\n", "lever", "setting", "peak", "saving",
                       "time", "fits", "how", "note");
  }
  for (const LeverTrial& l : levers) {
    if (!l.applies) {
      out += fmt::format("   {:<13} {:<26} {:>10} {:>10} {:>6} {:>5} {:>4}  {}\n", l.lever, l.setting, "-", "-", "-",
                         "-", "-", l.note);
      continue;
    }
    out += fmt::format("   {:<13} {:<26} {:>10} {:>10} {:>6} {:>5} {:>4}  {}\n", l.lever, l.setting,
                       format_bytes(l.peak_bytes),
                       (l.saving_bytes < 0 ? "-" : "") + format_bytes(std::abs(l.saving_bytes)),
                       l.step_time_ratio > 0 ? fmt::format("{:.2f}x", l.step_time_ratio) : "-", l.fits ? "yes" : "NO",
                       l.measured ? "run" : "est", l.note);
  }
  out += !oom ? "\n4. Plan: the configuration as given fits\n" : "\n4. Recommended plan\n";
  if (plan_found) {
    out += fmt::format("   {} ({})\n", plan.describe(), plan_note);
    out += fmt::format("   predicted peak {}; trained for 2 steps: peak {} of {} — {}\n",
                       format_bytes(plan.predicted_peak_bytes), format_bytes(verified_peak_bytes), format_bytes(budget),
                       plan_verified ? "fits" : "DID NOT FIT");
    std::string flags;
    for (const auto& o : config.overrides) flags += " --set " + o;
    if (!config.data.empty()) flags += " --data " + config.data;
    if (config.allocator == AllocatorKind::caching) flags += " --allocator caching";
    if (!config.allocator_conf.empty()) flags += " --allocator-conf '" + config.allocator_conf + "'";
    out += fmt::format(
        "   run it: headroom train --model {}{} --device {} --seed {} --seq {} --batch {} --accum {} "
        "--precision {} --checkpointing {} --attention {} --optimizer {} --memory-budget {}\n",
        config.model, flags, config.device, config.seed, config.seq, plan.batch, plan.accum,
        precision_name(plan.precision), plan.checkpointing.name(), attention_path_name(plan.attention),
        optimizer_name(plan.optimizer), budget);
    if (!options.empty()) {
      out += "   faster options that change the numerics (precision or optimizer), by the cost model:\n";
      for (const Plan& p : options) {
        out +=
            fmt::format("     {}: {:.2f}x the step time of the plan above, predicted peak {}\n", p.describe(),
                        p.predicted_step_seconds / plan.predicted_step_seconds, format_bytes(p.predicted_peak_bytes));
      }
    }
  } else {
    out += "   " + plan_note + "\n";
  }
  out += fmt::format("\n(diagnosed in {:.0f} s)\n", seconds);
  return out;
}

}  // namespace headroom
