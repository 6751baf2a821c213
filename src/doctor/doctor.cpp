#include "doctor/doctor.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>

#include "device/cuda_adapter.h"
#include "device/device.h"
#include "memory/allocator_config.h"
#include "memory/oom_report.h"
#include "plan/cost_model.h"
#include "plan/levers.h"
#include "plan/oom_advice.h"
#include "train/step_timing.h"
#include "train/trainer.h"
#include "util/error.h"
#include "util/size.h"

namespace headroom {
namespace {

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
    changes_ = lever_changes(cfg_, model_);
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
      try {
        r_.levers.push_back(
            data_parallel_trial(c, kRanks, device_.is_cuda(), budget_, r_.measured_peak, reference_seconds_));
      } catch (const Error& e) {
        r_.levers.push_back({lever, setting, false, false, 0, 0, 0, std::string("not run: ") + e.what()});
        return;
      }
    }
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
        precision_ratio_, [&](const std::string& line) { say("4/5 " + line); },
        [&timing] { return host_link_bytes_per_second(timing.device); });
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

}  // namespace headroom
