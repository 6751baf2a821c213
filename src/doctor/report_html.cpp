#include "doctor/report_html.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "report/html_page.h"
#include "util/size.h"

namespace headroom {
namespace {

std::string escape(const std::string& s) { return html_escape(s); }

const std::map<std::string, std::string>& phase_colours() {
  static const std::map<std::string, std::string> c = {{"data", "#9e9e9e"},
                                                       {"forward", "#1f77b4"},
                                                       {"backward", "#d62728"},
                                                       {"optimizer", "#2ca02c"},
                                                       {"zero_grad", "#ff7f0e"}};
  return c;
}

// Live memory through each phase of the verification run: in, peak, out per phase, coloured by phase.
std::string timeline_svg(const DoctorReport& r) {
  const double w = 900, h = 260, left = 70, right = 20, top = 20, bottom = 40;
  int64_t ymax = r.budget;
  for (const auto& p : r.timeline) ymax = std::max(ymax, p.peak);
  if (r.timeline.empty() || ymax <= 0) return "<p>No run to chart (no plan fitted).</p>";
  const double n = static_cast<double>(r.timeline.size() * 3);
  auto x = [&](double i) { return left + (w - left - right) * i / std::max(1.0, n - 1); };
  auto y = [&](int64_t b) {
    return top + (h - top - bottom) * (1.0 - static_cast<double>(b) / static_cast<double>(ymax));
  };
  std::string svg = svg_open("timeline", w, h);
  svg +=
      fmt::format(R"(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#000"/>)", left, h - bottom, w - right, h - bottom);
  svg += fmt::format(
      R"(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#b00" stroke-dasharray="6,4"/><text x="{}" y="{}" font-size="12" fill="#b00">budget {}</text>)",
      left, y(r.budget), w - right, y(r.budget), left + 4, y(r.budget) - 4, escape(format_bytes(r.budget)));
  for (int k = 0; k <= 4; ++k) {
    const int64_t b = ymax * k / 4;
    svg += fmt::format(R"(<text x="{}" y="{}" font-size="11" text-anchor="end">{}</text>)", left - 6, y(b) + 4,
                       escape(format_bytes(b)));
  }
  for (size_t i = 0; i < r.timeline.size(); ++i) {
    const PhasePoint& p = r.timeline[i];
    const double i0 = static_cast<double>(i * 3);
    const auto colour = phase_colours().count(p.phase) ? phase_colours().at(p.phase) : std::string("#555");
    svg += fmt::format(
        R"(<polyline class="phase" data-phase="{}" fill="none" stroke="{}" stroke-width="2" points="{:.1f},{:.1f} {:.1f},{:.1f} {:.1f},{:.1f}"><title>step {} {}: in {}, peak {}, out {}</title></polyline>)",
        p.phase, colour, x(i0), y(p.live_in), x(i0 + 1), y(p.peak), x(i0 + 2), y(p.live_out), p.step, p.phase,
        escape(format_bytes(p.live_in)), escape(format_bytes(p.peak)), escape(format_bytes(p.live_out)));
    if (p.phase == "data") {
      svg += fmt::format(R"(<text x="{:.1f}" y="{}" font-size="11">step {}</text>)", x(i0), h - bottom + 16, p.step);
    }
  }
  double lx = left;
  for (const auto& [name, colour] : phase_colours()) {
    svg += fmt::format(
        R"(<rect x="{}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{}" font-size="11">{}</text>)", lx,
        h - 14, colour, lx + 14, h - 5, name);
    lx += 110;
  }
  return svg + "</svg>";
}

// Horizontal bars, two per category: measured and estimated.
std::string breakdown_svg(const DoctorReport& r) {
  const int64_t est_act = r.estimate.step_memory();
  const std::vector<std::tuple<std::string, int64_t, int64_t>> rows = {
      {"weights", r.measured.weights, r.estimate.category(sim::Category::weights)},
      {"gradients", r.measured.gradients, r.estimate.category(sim::Category::gradients)},
      {"optimizer", r.measured.optimizer, r.estimate.category(sim::Category::optimizer)},
      {"activations etc.", r.measured.activations, est_act},
      {"other", r.measured.other, r.estimate.category(sim::Category::other)},
  };
  int64_t vmax = 1;
  for (const auto& [n, m, e] : rows) vmax = std::max({vmax, m, e});
  const double w = 900, label = 140, bar_h = 14, gap = 12;
  const double h = static_cast<double>(rows.size()) * (2 * bar_h + gap) + 30;
  std::string svg = svg_open("breakdown", w, h);
  double yy = 10;
  for (const auto& [name, m, e] : rows) {
    const double wm = (w - label - 120) * static_cast<double>(m) / static_cast<double>(vmax);
    const double we = (w - label - 120) * static_cast<double>(e) / static_cast<double>(vmax);
    svg += fmt::format(R"(<text x="0" y="{:.1f}" font-size="12">{}</text>)", yy + bar_h, escape(name));
    svg += fmt::format(
        R"(<rect class="measured" x="{}" y="{:.1f}" width="{:.1f}" height="{}" fill="#1f77b4"/><text x="{:.1f}" y="{:.1f}" font-size="11">measured {}</text>)",
        label, yy, wm, bar_h, label + wm + 4, yy + 11, escape(format_bytes(m)));
    svg += fmt::format(
        R"(<rect class="estimated" x="{}" y="{:.1f}" width="{:.1f}" height="{}" fill="#aec7e8"/><text x="{:.1f}" y="{:.1f}" font-size="11">estimated {}</text>)",
        label, yy + bar_h, we, bar_h, label + we + 4, yy + bar_h + 11, escape(format_bytes(e)));
    yy += 2 * bar_h + gap;
  }
  return svg + "</svg>";
}

// Each lever's measured peak against the budget.
std::string levers_svg(const DoctorReport& r) {
  std::vector<const LeverTrial*> tried;
  for (const auto& l : r.levers) {
    if (l.applies) tried.push_back(&l);
  }
  int64_t vmax = std::max(r.budget, r.measured_peak);
  for (const auto* l : tried) vmax = std::max(vmax, l->peak_bytes);
  const double w = 900, label = 250, bar_h = 16, gap = 6;
  const double h = static_cast<double>(tried.size() + 1) * (bar_h + gap) + 30;
  auto scale = [&](int64_t b) { return (w - label - 120) * static_cast<double>(b) / static_cast<double>(vmax); };
  std::string svg = svg_open("levers", w, h);
  double yy = 10;
  auto bar = [&](const std::string& name, int64_t peak, bool fits) {
    svg += fmt::format(
        R"(<text x="0" y="{:.1f}" font-size="12">{}</text><rect class="lever" x="{}" y="{:.1f}" width="{:.1f}" height="{}" fill="{}"/><text x="{:.1f}" y="{:.1f}" font-size="11">{}</text>)",
        yy + 12, escape(name), label, yy, scale(peak), bar_h, fits ? "#2ca02c" : "#d62728", label + scale(peak) + 4,
        yy + 12, escape(format_bytes(peak)));
    yy += bar_h + gap;
  };
  bar("as given", r.measured_peak, !r.oom);
  for (const auto* l : tried) bar(l->lever + ": " + l->setting, l->peak_bytes, l->fits);
  svg += fmt::format(
      R"(<line x1="{:.1f}" y1="0" x2="{:.1f}" y2="{:.1f}" stroke="#b00" stroke-dasharray="6,4"/><text x="{:.1f}" y="{:.1f}" font-size="11" fill="#b00">budget</text>)",
      label + scale(r.budget), label + scale(r.budget), yy, label + scale(r.budget) + 4, yy + 12);
  return svg + "</svg>";
}

// The title and the configuration as given.
std::string page_heading(const DoctorReport& r) {
  std::string html = fmt::format("<h1>headroom doctor: {} on {}, budget {}</h1>\n", escape(r.estimate.model),
                                 escape(r.device), escape(format_bytes(r.budget)));
  html += fmt::format(
      "<p>As given: micro-batch {} × accum {} × seq {}, {}, {}, checkpointing {}, {} attention. "
      "Diagnosed in {:.0f} s.</p>\n",
      r.config.batch, r.config.accum, r.config.seq, escape(precision_name(r.config.precision)),
      escape(optimizer_name(r.config.optimizer)), escape(r.config.checkpointing.name()),
      escape(attention_path_name(r.config.attention)), r.seconds);
  return html;
}

// 1. The verdict and the memory by category, measured against estimated.
std::string what_happened_section(const DoctorReport& r) {
  std::string html = "<h2>1. What happened</h2>\n";
  html += r.oom ? fmt::format("<p class=\"bad\" id=\"verdict\">Out of memory in {} of step {}.</p><pre>{}</pre>\n",
                              escape(r.oom_phase), r.oom_step, escape(r.oom_text))
                : fmt::format("<p class=\"good\" id=\"verdict\">It fits: peak {} of {}.</p>\n",
                              escape(format_bytes(r.measured_peak)), escape(format_bytes(r.budget)));
  html += "<p>Memory by category at the step's peak, measured" +
          std::string(r.oom && !r.measured_whole_step ? " at the failure (a lower bound)"
                      : r.measured_whole_step         ? " (without the budget)"
                                                      : "") +
          " and estimated:</p>\n" + breakdown_svg(r) + "\n";
  return html;
}

// 2. The leak check, its sites, and fragmentation.
std::string leaks_section(const DoctorReport& r) {
  std::string html = "<h2>2. Leaks and fragmentation</h2>\n";
  html += fmt::format("<p id=\"leak\"><b>{}</b> — {} ({})</p>\n", r.leak.detected ? "Leak detected" : "No leak",
                      escape(r.leak.reason), escape(r.leak_run));
  if (!r.leak.sites.empty()) {
    html += "<ul>";
    for (const auto& s : r.leak.sites) html += "<li>" + escape(s.description) + "</li>";
    html += "</ul>\n";
  }
  html += "<p>Fragmentation: " + escape(r.fragmentation) + "</p>\n";
  return html;
}

// One row of the lever table.
std::string lever_row(const LeverTrial& l) {
  if (!l.applies) {
    return fmt::format("<tr><td>{}</td><td>{}</td><td colspan=\"5\">does not apply</td><td>{}</td></tr>\n",
                       escape(l.lever), escape(l.setting), escape(l.note));
  }
  return fmt::format(
      "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}{}</td>"
      "<td class=\"num\">{}</td><td class=\"{}\">{}</td><td>{}</td><td>{}</td></tr>\n",
      escape(l.lever), escape(l.setting), escape(format_bytes(l.peak_bytes)), l.saving_bytes < 0 ? "−" : "",
      escape(format_bytes(std::abs(l.saving_bytes))),
      l.step_time_ratio > 0 ? fmt::format("{:.2f}×", l.step_time_ratio) : "—", l.fits ? "good" : "bad",
      l.fits ? "yes" : "no", l.measured ? "run" : "est", escape(l.note));
}

// 3. Each lever's peak as a chart and a table.
std::string levers_section(const DoctorReport& r) {
  std::string html =
      "<h2>3. Levers</h2>\n<p>Peak of each lever against the budget (green: fits); \"run\": measured in a real "
      "step, \"est\": predicted by the estimator and the cost model.</p>\n" +
      levers_svg(r) + "\n";
  html += fmt::format(
      "<table id=\"lever-table\"><tr><th>lever</th><th>setting</th><th>peak</th><th>saving</th>"
      "<th>step time (vs {})</th><th>fits</th><th>how</th><th>note</th></tr>\n",
      escape(r.reference));
  for (const auto& l : r.levers) html += lever_row(l);
  html += "</table>\n";
  return html;
}

// The plan found: its settings and verification, the faster options, its steps' timeline.
std::string plan_found(const DoctorReport& r) {
  std::string html = fmt::format(
      "<p id=\"plan\">Micro-batch {} × accum {}, {}, checkpointing {}, {} attention, {} — predicted "
      "peak {}; trained for 2 steps: peak {} of {} (<span class=\"{}\">{}</span>). {}.</p>\n",
      r.plan.batch, r.plan.accum, escape(precision_name(r.plan.precision)), escape(r.plan.checkpointing.name()),
      escape(attention_path_name(r.plan.attention)), escape(optimizer_name(r.plan.optimizer)),
      escape(format_bytes(r.plan.predicted_peak_bytes)), escape(format_bytes(r.verified_peak_bytes)),
      escape(format_bytes(r.budget)), r.plan_verified ? "good" : "bad", r.plan_verified ? "fits" : "did not fit",
      escape(r.plan_note));
  if (!r.options.empty()) {
    html += "<p>Faster options that change the numerics (precision or optimizer), by the cost model:</p><ul>";
    for (const Plan& p : r.options) {
      html += fmt::format("<li>{}: {:.2f}× the step time, predicted peak {}</li>", escape(p.describe()),
                          p.predicted_step_seconds / r.plan.predicted_step_seconds,
                          escape(format_bytes(p.predicted_peak_bytes)));
    }
    html += "</ul>\n";
  }
  html += "<p>Memory through each phase of those steps:</p>\n" + timeline_svg(r) + "\n";
  if (!r.snapshot.empty()) {
    html += "<p>PyTorch's memory snapshot of these steps: <code>" + escape(r.snapshot) +
            "</code> (diagnose it with <code>headroom analyze</code>, or open it in pytorch.org/memory_viz).</p>\n";
  }
  return html;
}

// 4. The plan, or why there is none.
std::string plan_section(const DoctorReport& r) {
  std::string html = !r.oom ? "<h2>4. Plan: the configuration as given fits</h2>\n" : "<h2>4. Recommended plan</h2>\n";
  if (r.plan_found) return html + plan_found(r);
  return html + "<p id=\"plan\" class=\"bad\">" + escape(r.plan_note) + "</p>\n";
}

}  // namespace

std::string report_html(const DoctorReport& r) {
  std::string html = html_page_head("headroom doctor");
  html += page_heading(r);
  html += what_happened_section(r);
  html += leaks_section(r);
  html += levers_section(r);
  html += plan_section(r);
  return html + "</body></html>\n";
}

}  // namespace headroom
