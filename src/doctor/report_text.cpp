// The diagnosis as its JSON object and as the text a person reads, section by section in lever order.
#include <fmt/format.h>

#include <cstdlib>

#include "doctor/doctor.h"
#include "util/size.h"

namespace headroom {

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

namespace {

// The flags of `headroom train` that run `plan` under the configuration's budget: plan_keys()
// always, anything else the configuration changes from the defaults, but
// neither its outputs nor a planted leak.
std::vector<std::string> train_args(const RunConfig& config, const Plan& plan) {
  RunConfig run = with_plan(config, plan);
  run.json = run.quiet = false;
  run.memory_snapshot.clear();
  run.inject_leak = LeakInjection::none;
  return run_args(run, RunConfig{}, plan_keys());
}

// 1. what happened, and the breakdown measured next to the estimate
std::string what_happened_text(const DoctorReport& r) {
  std::string out;
  out += "1. What happened\n";
  if (r.oom) {
    out += r.oom_step == 0 ? std::string("   OUT OF MEMORY before the first step:\n")
                         : fmt::format("   OUT OF MEMORY in {} of step {}:\n", r.oom_phase, r.oom_step);
    // The facts and every category of what was in use (the largest is what to act on).
    std::string text = r.oom_text;
    size_t pos = 0;
    for (int i = 0; i < 7 && pos < text.size(); ++i) {
      const size_t nl = text.find('\n', pos);
      out += "     " + text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos) + "\n";
      if (nl == std::string::npos) break;
      pos = nl + 1;
    }
  } else {
    out += fmt::format("   it fits: peak {} of {}\n", format_bytes(r.measured_peak), format_bytes(r.budget));
  }
  const int64_t est_act = r.estimate.step_memory();
  const bool partial = r.oom && !r.measured_whole_step;
  out += fmt::format("   {:<34} {:>11} {:>11}\n",
                     partial ? "at the failure / whole step"
                             : (r.measured_whole_step ? "whole step, without the budget:" : "at the step's peak:"),
                     "measured", "estimated");
  auto row = [&](const char* name, int64_t m, int64_t e) {
    out += fmt::format("   {:<34} {:>11} {:>11}\n", name, format_bytes(m), format_bytes(e));
  };
  row("weights", r.measured.weights, r.estimate.category(sim::Category::weights));
  row("gradients", r.measured.gradients, r.estimate.category(sim::Category::gradients));
  row("optimizer state", r.measured.optimizer, r.estimate.category(sim::Category::optimizer));
  row("activations, logits, loss, temps", r.measured.activations, est_act);
  row("other (data)", r.measured.other, r.estimate.category(sim::Category::other));
  row(partial ? "total" : "peak", r.measured_peak, r.estimate.peak_bytes);
  out += fmt::format("   the estimate's peak is in {}\n\n", phase_name(r.estimate.peak_phase));
  return out;
}

// 2. the leak verdict and fragmentation
std::string leaks_text(const DoctorReport& r) {
  std::string out;
  out += "2. Leaks and fragmentation\n";
  if (r.leak_run.empty()) {
    out += "   leak: not checked\n";
  } else {
    out += fmt::format("   leak: {} ({})\n", r.leak.detected ? "DETECTED" : "none", r.leak_run);
  }
  out += "     " + r.leak.reason + "\n";
  for (const LeakSite& s : r.leak.sites) out += "     - " + s.description + "\n";
  out += "   fragmentation: " + r.fragmentation + "\n\n";
  return out;
}

// 3. each lever tried, a row each
std::string levers_text(const DoctorReport& r) {
  std::string out;
  if (r.levers.empty()) {
    out += "3. Levers: not tried\n";
  } else {
    out += fmt::format(
        "3. Levers (step time relative to {}; \"run\": measured in a real step, \"est\": predicted by the "
        "estimator and the cost model)\n",
        r.reference.empty() ? "-" : r.reference);
  }
  if (!r.levers.empty()) {
    out += fmt::format("   {:<13} {:<26} {:>10} {:>10} {:>6} {:>5} {:>4}  {}\n", "lever", "setting", "peak", "saving",
                       "time", "fits", "how", "note");
  }
  for (const LeverTrial& l : r.levers) {
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
  return out;
}

// 4. the recommended plan and the command that runs it
std::string plan_text(const DoctorReport& r) {
  std::string out;
  out += !r.oom ? "\n4. Plan: the configuration as given fits\n" : "\n4. Recommended plan\n";
  if (r.plan_found) {
    out += fmt::format("   {} ({})\n", r.plan.describe(), r.plan_note);
    out += fmt::format("   predicted peak {}; trained for 2 steps: peak {} of {} — {}\n",
                       format_bytes(r.plan.predicted_peak_bytes), format_bytes(r.verified_peak_bytes), format_bytes(r.budget),
                       r.plan_verified ? "fits" : "DID NOT FIT");
    out += "   run it: headroom train " + shell_line(train_args(r.config, r.plan)) + "\n";
    if (!r.options.empty()) {
      out += "   faster options that change the numerics (precision or optimizer), by the cost model:\n";
      for (const Plan& p : r.options) {
        out +=
            fmt::format("     {}: {:.2f}x the step time of the plan above, predicted peak {}\n", p.describe(),
                        p.predicted_step_seconds / r.plan.predicted_step_seconds, format_bytes(p.predicted_peak_bytes));
      }
    }
  } else {
    out += "   " + r.plan_note + "\n";
  }
  return out;
}

}  // namespace

std::string DoctorReport::to_text() const {
  std::string out = fmt::format("headroom doctor: {} ({:.2f}M params) on {}, budget {}\n  as given: {}, seq {}\n\n",
                                estimate.model, static_cast<double>(estimate.params) / 1e6, device,
                                format_bytes(budget), plan_of(config).describe(), config.seq);
  out += what_happened_text(*this) + leaks_text(*this) + levers_text(*this) + plan_text(*this);
  out += fmt::format("\n(diagnosed in {:.0f} s)\n", seconds);
  return out;
}

}  // namespace headroom
