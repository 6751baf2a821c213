#include "doctor/doctor.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include "device/cuda_adapter.h"
#include "device/device.h"
#include "memory/oom_report.h"
#include "plan/levers.h"
#include "plan/oom_advice.h"
#include "train/static_graph.h"
#include "train/step_timing.h"
#include "train/trainer.h"
#include "util/error.h"
#include "util/interrupt.h"
#include "util/files.h"
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

std::string describe_run(const RunConfig& c) {
  return fmt::format("micro-batch {} x accum {}, {}, checkpointing {}, {} attention, {}", c.batch, c.accum,
                     precision_name(c.precision), c.checkpointing.name(), attention_path_name(c.attention),
                     optimizer_name(c.optimizer));
}

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

// Lever 10 on cuda: one step on the warm cache, empty_cache(), one step again; what it returned to
// the driver and what the cold step cost.
LeverTrial empty_cache_trial(const RunConfig& reference, int device, int64_t budget) {
  LeverTrial l{"empty-cache", "torch.cuda.empty_cache()", true, false, 0, 0, 0, ""};
  const TrialRun warm = run_trial(reference, 1);
  const CudaMemoryStats before = cuda_memory_stats(device);
  const auto t0 = std::chrono::steady_clock::now();
  cuda_empty_cache();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const CudaMemoryStats after = cuda_memory_stats(device);
  const TrialRun cold = run_trial(reference, 1);
  l.fits = cold.fits && cold.peak <= budget;
  l.peak_bytes = cold.peak;
  l.step_time_ratio = warm.fits && cold.fits ? cold.first_step_seconds / warm.first_step_seconds : 0;
  l.note = fmt::format(
      "returned {} of {} reserved to the driver in {:.1f} ms ({} still allocated); the step after it, timed "
      "against one on the warm cache, reserves its blocks again; it lowers what the process holds between "
      "steps, not the step's peak",
      format_bytes(before.reserved_bytes - after.reserved_bytes), format_bytes(before.reserved_bytes), 1e3 * seconds,
      format_bytes(after.allocated_bytes));
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

DoctorReport run_doctor(const RunConfig& given, int64_t budget,
                        const std::function<void(const std::string&)>& progress) {
  const auto start = std::chrono::steady_clock::now();
  auto say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  DoctorReport r;
  RunConfig cfg = given;
  cfg.memory_budget = budget;
  r.config = cfg;
  r.budget = budget;
  r.device = resolve_device(cfg.device).str();
  const ModelConfig model = load_model_config(cfg.model, cfg.overrides);
  const int64_t global = cfg.batch * cfg.accum;

  // (1) What happened.
  say(fmt::format("1/5 running the configuration as given: {}, 3 steps under {}", describe_run(cfg),
                  format_bytes(budget)));
  const TrialRun base = run_trial(cfg, 3);
  r.oom = !base.fits;
  r.measured_peak = base.peak;
  r.measured = base.breakdown;
  if (r.oom) {
    r.oom_phase = std::string(phase_name(base.oom.phase));
    r.oom_step = base.oom.step;
    OomReport report = base.oom;
    report.advice = oom_advice(report, as_trial(cfg, 3));
    r.oom_text = report.to_text();
    r.measured = base.oom.breakdown;
  }
  r.estimate = estimate(model, train_spec(cfg));
  // On cpu the whole step can be measured on the machine's own memory: every peak below is a real
  // one, compared with the budget, not a failure's lower bound. (On cuda the card is the limit.)
  const bool free_trials = !resolve_device(cfg.device).is_cuda();
  double reference_seconds = 0;
  if (free_trials) {
    say("1/5 measuring the whole step as given, on the machine's memory");
    const TrialRun whole = run_trial(cfg, 1, false);
    if (whole.fits) {
      r.measured_peak = whole.peak;
      r.measured = whole.breakdown;
      r.measured_whole_step = true;
      reference_seconds = whole.first_step_seconds;
      r.reference = "the configuration as given";
    }
  }

  // (2) Leaks, at a micro-batch that fits; its step time is the levers' reference.
  RunConfig reference = cfg;
  if (r.oom) {
    const int64_t m = std::max<int64_t>(1, largest_fitting_micro(model, cfg, budget));
    reference.batch = m;
    reference.accum = (global + m - 1) / m;
  }
  r.leak_run = fmt::format("{}, 12 steps", describe_run(reference));
  say("2/5 leak check: " + r.leak_run);
  RunConfig leak_config = reference;
  leak_config.leak_origins = true;  // cuda: the allocator tags each allocation with its step and phase
  const TrialRun leak_trial = run_trial(leak_config, 12, !free_trials);
  r.leak = judge_growth(leak_trial.result.live_series());
  if (!leak_trial.fits) {
    r.leak.reason += fmt::format("; the run ran out of memory in step {} of 12{}", leak_trial.oom.step,
                                 r.leak.detected ? ", as the growth predicts" : "");
  }
  if (leak_trial.fits) {
    if (r.leak.detected) r.leak.sites = leak_trial.result.summary.surviving;
    if (reference_seconds == 0) {
      reference_seconds = leak_trial.first_step_seconds;
      r.reference = describe_run(reference);
    }
  }
  if (resolve_device(cfg.device).is_cuda()) {
    const CudaMemoryStats st = cuda_memory_stats(resolve_device(cfg.device).index());
    r.fragmentation = fmt::format(
        "reserved {} vs allocated {}: {} cached but unused ({} of it split inside live "
        "segments)",
        format_bytes(st.reserved_bytes), format_bytes(st.allocated_bytes),
        format_bytes(st.reserved_bytes - st.allocated_bytes), format_bytes(st.inactive_split_bytes));
  } else {
    r.fragmentation =
        "does not apply on cpu: the budget allocator hands memory straight back, there is no cache to "
        "fragment (on cuda this compares reserved with allocated)";
  }

  // (3-8) Each applicable lever, tried for real from the configuration as given.
  const std::vector<LeverChange> changes = lever_changes(cfg, model.num_layers);
  int index = 0;
  std::map<Precision, double> precision_ratio;  // step time against the configuration's precision
  for (const LeverChange& ch : changes) {
    say(fmt::format("3/5 lever {}/{}: {} {}", ++index, changes.size(), lever_name(ch.lever), ch.setting));
    RunConfig c = cfg;
    ch.apply(c);
    const TrialRun t = run_trial(c, 1, !free_trials);
    LeverTrial lt;
    lt.lever = lever_name(ch.lever);
    lt.setting = ch.setting;
    lt.fits = t.fits && t.peak <= budget;
    lt.peak_bytes = t.peak;
    lt.saving_bytes = r.measured_peak - t.peak;
    lt.step_time_ratio = t.fits && reference_seconds > 0 ? t.first_step_seconds / reference_seconds : 0;
    lt.note = ch.note + (t.fits ? "" : "; out of memory (peak: in use at the failure plus the request)");
    if (r.measured_whole_step && ch.lever == Lever::precision && t.fits && lt.step_time_ratio > 0)
      precision_ratio[c.precision] = lt.step_time_ratio;
    r.levers.push_back(lt);
  }
  if (r.measured_whole_step) {
    // The first steps of a process run slower (the allocator and the kernels warm up): the
    // configuration's own step is timed again after the levers, and the faster time is the reference.
    const TrialRun again = run_trial(cfg, 1, false);
    if (again.fits && again.first_step_seconds < reference_seconds) {
      const double scale = reference_seconds / again.first_step_seconds;
      reference_seconds = again.first_step_seconds;
      for (LeverTrial& l : r.levers) l.step_time_ratio *= scale;
      for (auto& [p, ratio] : precision_ratio) ratio *= scale;
    }
  }
  const at::Device device = resolve_device(cfg.device);
  const std::string at_reference =
      reference.batch == cfg.batch ? "" : fmt::format(" (at the leak check's micro-batch {})", reference.batch);
  if (device.is_cuda()) {
    say("3/5 lever: empty-cache, a step on the warm cache and one after emptying it");
    LeverTrial empty = empty_cache_trial(reference, device.index(), budget);
    empty.saving_bytes = r.measured_peak - empty.peak_bytes;
    empty.note += at_reference;
    r.levers.push_back(empty);
    say("3/5 lever: static graph, eager steps then the step captured as a CUDA graph and replayed");
    LeverTrial graphed = static_graph_trial(reference, budget);
    graphed.note += at_reference;
    r.levers.push_back(graphed);
  } else {
    r.levers.push_back({"empty-cache", "torch.cuda.empty_cache()", false, false, 0, 0, 0,
                        "does not apply on cpu: there is no cache to empty"});
    r.levers.push_back({"static graph", "CUDA graphs", false, false, 0, 0, 0,
                        "does not apply on cpu: CUDA graphs capture GPU kernel launches"});
  }

  // The recommendation, and its proof.
  say("4/5 planning: the estimator's candidates under the budget, ranked by a calibrated cost model");
  PlanRequest pr;
  pr.base = cfg;
  pr.global_batch = global;
  pr.budget = budget;
  // The step-time model: calibrated in the configuration's precision; other precisions scaled by
  // what their lever trials measured (or timed now, when a trial did not run to the end).
  RunConfig timing = cfg;
  timing.memory_budget.reset();
  const PlanResult plans = plan_with_calibration(
      pr, [&timing](Precision p, int64_t rows, int timed) { return time_train_step(timing, p, rows, timed); },
      precision_ratio, [&](const std::string& line) { say("4/5 " + line); });
  if (!plans.plans.empty()) {
    r.plan_found = true;
    r.plan = plans.plans.front();
    say(fmt::format("5/5 training the recommended plan for 3 steps under {}", format_bytes(budget)));
    // On cuda, PyTorch's memory snapshot of these steps goes next to the report.
    const TrialRun v = run_trial(with_plan(cfg, r.plan), 3, true, given.memory_snapshot);
    if (!given.memory_snapshot.empty() && v.fits) r.snapshot = given.memory_snapshot;
    r.plan_verified = v.fits;
    r.verified_peak_bytes = v.peak;
    r.timeline = v.timeline;
    r.plan_note = fmt::format("best of {} plans that fit ({} considered)", plans.plans.size(), plans.considered);
  } else {
    r.plan_note = fmt::format("no plan fits: the smallest predicted peak is {} ({})", format_bytes(plans.smallest_peak),
                              plans.smallest_peak_plan);
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
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
         {"note", l.note}});
  }
  nlohmann::json plan_json;
  if (plan_found) {
    plan_json = plan.to_json();
    plan_json["verified_peak_bytes"] = verified_peak_bytes;
    plan_json["verified"] = plan_verified;
  }
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
          {"plan", plan_json},
          {"seconds", seconds}};
}

std::string DoctorReport::to_text() const {
  std::string out;
  out += fmt::format("headroom doctor: {} ({:.2f}M params) on {}, budget {}\n  as given: {}, seq {}\n\n",
                     estimate.model, static_cast<double>(estimate.params) / 1e6, device, format_bytes(budget),
                     describe_run(config), config.seq);
  out += "1. What happened\n";
  if (oom) {
    out += fmt::format("   OUT OF MEMORY in {} of step {}:\n", oom_phase, oom_step);
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
  out += fmt::format("   leak: {} ({})\n", leak.detected ? "DETECTED" : "none", leak_run);
  out += "     " + leak.reason + "\n";
  for (const LeakSite& s : leak.sites) out += "     - " + s.description + "\n";
  out += "   fragmentation: " + fragmentation + "\n\n";

  out +=
      fmt::format("3. Levers, each tried for real (step time relative to {})\n", reference.empty() ? "-" : reference);
  out += fmt::format("   {:<13} {:<26} {:>10} {:>10} {:>6} {:>5}  {}\n", "lever", "setting", "peak", "saving", "time",
                     "fits", "note");
  for (const LeverTrial& l : levers) {
    if (!l.applies) {
      out += fmt::format("   {:<13} {:<26} {:>10} {:>10} {:>6} {:>5}  {}\n", l.lever, l.setting, "-", "-", "-", "-",
                         l.note);
      continue;
    }
    out += fmt::format(
        "   {:<13} {:<26} {:>10} {:>10} {:>6} {:>5}  {}\n", l.lever, l.setting, format_bytes(l.peak_bytes),
        (l.saving_bytes < 0 ? "-" : "") + format_bytes(std::abs(l.saving_bytes)),
        l.step_time_ratio > 0 ? fmt::format("{:.2f}x", l.step_time_ratio) : "-", l.fits ? "yes" : "NO", l.note);
  }
  out += "\n4. Recommended plan\n";
  if (plan_found) {
    out += fmt::format("   {} ({})\n", plan.describe(), plan_note);
    out += fmt::format("   predicted peak {}; trained for 3 steps: peak {} of {} — {}\n",
                       format_bytes(plan.predicted_peak_bytes), format_bytes(verified_peak_bytes), format_bytes(budget),
                       plan_verified ? "fits" : "DID NOT FIT");
    std::string flags;
    for (const auto& o : config.overrides) flags += " --set " + o;
    if (!config.data.empty()) flags += " --data " + config.data;
    out += fmt::format(
        "   run it: headroom train --model {}{} --device {} --seed {} --seq {} --batch {} --accum {} "
        "--precision {} --checkpointing {} --attention {} --optimizer {} --memory-budget {}\n",
        config.model, flags, config.device, config.seed, config.seq, plan.batch, plan.accum,
        precision_name(plan.precision), plan.checkpointing.name(), attention_path_name(plan.attention),
        optimizer_name(plan.optimizer), budget);
  } else {
    out += "   " + plan_note + "\n";
  }
  out += fmt::format("\n(diagnosed in {:.0f} s)\n", seconds);
  return out;
}

}  // namespace headroom
