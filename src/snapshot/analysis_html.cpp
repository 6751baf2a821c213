#include "snapshot/analysis_html.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "report/html_page.h"
#include "util/size.h"

namespace headroom {
namespace {

std::string bytes(int64_t b) { return html_escape(format_bytes(b)); }

// Reserved (line) and allocated (a band from each bucket's lowest to its highest) over the trace's
// events, with the peaks, the iteration starts (at most 60 ticks) and the OOMs marked.
std::string timeline_svg(const DeviceAnalysis& d) {
  if (d.timeline.empty()) return "<p>No trace to chart.</p>";
  const double w = 900, h = 280, left = 80, right = 20, top = 20, bottom = 40;
  const int64_t ymax = std::max<int64_t>(1, std::max(d.peak_reserved, d.peak_allocated));
  const double n = static_cast<double>(std::max<int64_t>(1, d.events));
  auto x = [&](double event) { return left + (w - left - right) * event / n; };
  auto y = [&](int64_t b) {
    return top + (h - top - bottom) * (1.0 - static_cast<double>(b) / static_cast<double>(ymax));
  };
  std::string svg = svg_open(fmt::format("timeline-{}", d.device), w, h);
  svg +=
      fmt::format(R"(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#000"/>)", left, h - bottom, w - right, h - bottom);
  for (int k = 0; k <= 4; ++k) {
    const int64_t b = ymax * k / 4;
    svg += fmt::format(R"(<text x="{}" y="{:.1f}" font-size="11" text-anchor="end">{}</text>)", left - 6, y(b) + 4,
                       bytes(b));
  }
  std::string band_top, band_bottom, reserved;
  for (size_t i = 0; i < d.timeline.size(); ++i) {
    const TimelineBucket& t = d.timeline[i];
    const int64_t next = i + 1 < d.timeline.size() ? d.timeline[i + 1].first_event : d.events;
    const double x0 = x(static_cast<double>(t.first_event)), x1 = x(static_cast<double>(next));
    band_top += fmt::format("{:.1f},{:.1f} {:.1f},{:.1f} ", x0, y(t.allocated_max), x1, y(t.allocated_max));
    band_bottom =
        fmt::format("{:.1f},{:.1f} {:.1f},{:.1f} ", x1, y(t.allocated_min), x0, y(t.allocated_min)) + band_bottom;
    reserved += fmt::format("{:.1f},{:.1f} {:.1f},{:.1f} ", x0, y(t.reserved_max), x1, y(t.reserved_max));
  }
  svg += fmt::format(R"(<polygon class="allocated" points="{}{}" fill="#1f77b4" fill-opacity="0.55" stroke="none"/>)",
                     band_top, band_bottom);
  svg += fmt::format(R"(<polyline class="reserved" points="{}" fill="none" stroke="#d62728" stroke-width="1.5"/>)",
                     reserved);
  const size_t its = d.iterations.size();
  const size_t every = std::max<size_t>(1, (its + 59) / 60);
  for (size_t k = 0; k < its; k += every) {
    const double xi = x(static_cast<double>(d.iterations[k].first_event));
    svg += fmt::format(R"(<line class="iteration" x1="{:.1f}" y1="{}" x2="{:.1f}" y2="{}" stroke="#888"/>)", xi,
                       h - bottom, xi, h - bottom + 6);
  }
  if (d.peak_allocated_event >= 0) {
    svg += fmt::format(
        R"(<circle class="peak" cx="{:.1f}" cy="{:.1f}" r="4" fill="#1f77b4"><title>peak allocated {} at event {}</title></circle>)",
        x(static_cast<double>(d.peak_allocated_event)), y(d.peak_allocated), bytes(d.peak_allocated),
        d.peak_allocated_event);
  }
  for (const SnapshotOom& o : d.ooms) {
    const double xo = x(static_cast<double>(o.event));
    svg += fmt::format(
        R"(<line class="oom" x1="{:.1f}" y1="{}" x2="{:.1f}" y2="{}" stroke="#b00" stroke-width="2"><title>OOM: {} asked</title></line>)",
        xo, top, xo, h - bottom, bytes(o.requested));
  }
  svg += fmt::format(
      R"(<rect x="{}" y="{}" width="10" height="10" fill="#1f77b4"/><text x="{}" y="{}" font-size="11">allocated (lowest to highest in each of {} spans)</text>)",
      left, h - 14, left + 14, h - 5, d.timeline.size());
  svg += fmt::format(
      R"(<rect x="{}" y="{}" width="10" height="10" fill="#d62728"/><text x="{}" y="{}" font-size="11">reserved</text>)",
      left + 400, h - 14, left + 414, h - 5);
  return svg + "</svg>";
}

std::string groups_table(const std::vector<SiteGroup>& groups, const std::string& id) {
  std::string t = fmt::format(
      "<table id=\"{}\"><tr><th>bytes</th><th>blocks</th><th>allocated at</th><th>called from</th></tr>\n", id);
  for (const SiteGroup& g : groups) {
    std::string callers;
    for (const std::string& c : g.callers) callers += (callers.empty() ? "" : " ← ") + html_escape(c);
    t += fmt::format("<tr><td class=\"num\">{}</td><td class=\"num\">{}</td><td><code>{}</code></td><td>{}</td></tr>\n",
                     bytes(g.bytes), g.count ? std::to_string(g.count) : "", html_escape(g.site), callers);
  }
  return t + "</table>\n";
}

// 1. The peaks, and what was live at the peak allocated.
std::string peak_section(const DeviceAnalysis& d) {
  std::string html = fmt::format(
      "<h2>1. Peak</h2>\n<p id=\"peak-{}\">Peak allocated {} (event {}), peak reserved {} (event {}). "
      "Live at the peak allocated, by the code that allocated it:</p>\n",
      d.device, bytes(d.peak_allocated), d.peak_allocated_event, bytes(d.peak_reserved), d.peak_reserved_event);
  return html + groups_table(d.live_at_peak, fmt::format("live-{}", d.device));
}

// 2. The iterations (the first 50) and the leak verdict with its sites.
std::string iterations_section(const DeviceAnalysis& d) {
  std::string html = fmt::format("<h2>2. Iterations and leaks</h2>\n<p>{}</p>\n", html_escape(d.iterations_reason));
  if (!d.iterations_found) return html;
  html += "<table><tr><th>iteration</th><th>first event</th><th>live at start</th><th>peak</th></tr>\n";
  const size_t show = std::min<size_t>(d.iterations.size(), 50);
  for (size_t k = 0; k < show; ++k) {
    html += fmt::format(
        "<tr><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>"
        "<td class=\"num\">{}</td></tr>\n",
        k + 1, d.iterations[k].first_event, bytes(d.iterations[k].live_at_start), bytes(d.iterations[k].peak));
  }
  html += "</table>\n";
  if (show < d.iterations.size()) html += fmt::format("<p>… and {} more.</p>\n", d.iterations.size() - show);
  html += fmt::format("<p id=\"leak-{}\" class=\"{}\"><b>{}</b> — {}</p>\n", d.device, d.leak.detected ? "bad" : "good",
                      d.leak.detected ? "Leak detected" : "No leak", html_escape(d.leak.reason));
  if (!d.leak.sites.empty()) {
    html += "<ul>";
    for (const LeakSite& s : d.leak.sites) html += "<li>" + html_escape(s.description) + "</li>";
    html += "</ul>\n";
  }
  return html;
}

// 10. The fragmentation verdict, the replays and the most fragmented segments.
std::string fragmentation_section(const DeviceAnalysis& d) {
  std::string html =
      fmt::format("<h2>10. Fragmentation and cached memory</h2>\n<p>{}.</p>\n", html_escape(d.fragmentation));
  if (!d.replays.empty()) {
    html +=
        "<table id=\"replays\"><tr><th>allocator setting (replayed)</th><th>peak reserved</th><th>saving</th></tr>\n";
    for (const PolicyReplay& p : d.replays) {
      html += fmt::format("<tr><td><code>{}</code></td><td class=\"num\">{}</td><td class=\"num\">{}{}</td></tr>\n",
                          html_escape(p.setting), bytes(p.peak_reserved), p.saving < 0 ? "−" : "",
                          bytes(std::abs(p.saving)));
    }
    html += "</table>\n";
  }
  if (!d.fragmented_segments.empty()) {
    html +=
        "<p>Segments with the most inactive-split bytes at the reserved peak:</p>\n<table><tr><th>segment</th>"
        "<th>pool</th><th>size</th><th>live</th><th>inactive split</th></tr>\n";
    for (const SegmentState& s : d.fragmented_segments) {
      html += fmt::format(
          "<tr><td><code>0x{:x}</code></td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>"
          "<td class=\"num\">{}</td></tr>\n",
          s.address, s.small ? "small" : "large", bytes(s.total), bytes(s.allocated), bytes(s.inactive_split));
    }
    html += "</table>\n";
  }
  return html;
}

// An OOM: what it met, what was live, and the levers.
std::string oom_section(const SnapshotOom& o) {
  std::string html = fmt::format(
      "<h2 class=\"bad\">Out of memory at event {}</h2>\n<p>Asked for {} at <code>{}</code>: {} live, {} reserved "
      "({} cached), the device had {} free; short by {}.</p>\n",
      o.event, bytes(o.requested), html_escape(o.stack), bytes(o.allocated), bytes(o.reserved), bytes(o.cached),
      o.device_free >= 0 ? bytes(o.device_free) : "an unknown amount", bytes(o.shortfall));
  html += groups_table(o.live, fmt::format("oom-live-{}", o.event));
  html += "<table><tr><th>lever</th><th>setting</th><th>bytes</th><th>would have avoided it</th><th>note</th></tr>\n";
  for (const OomLever& l : o.levers) {
    html += fmt::format("<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"{}\">{}</td><td>{}</td></tr>\n",
                        html_escape(l.lever), html_escape(l.setting), bytes(l.bytes), l.avoids ? "good" : "bad",
                        l.avoids ? "yes" : "no", html_escape(l.note));
  }
  return html + "</table>\n";
}

}  // namespace

std::string analysis_html(const SnapshotAnalysis& a) {
  std::string html = html_page_head("headroom analyze");
  html += fmt::format("<h1>headroom analyze: {}</h1>\n", html_escape(a.source));
  if (a.settings.known) {
    html += fmt::format("<p>Allocator settings: <code>{}</code></p>\n",
                        html_escape(a.settings.conf.empty() ? "(defaults)" : a.settings.conf));
  }
  for (const DeviceAnalysis& d : a.devices) {
    html += fmt::format("<h2>Device {}: {} segments, {} trace events</h2>\n", d.device, d.segments, d.events);
    html += timeline_svg(d) + "\n";
    html += peak_section(d);
    html += iterations_section(d);
    html += fragmentation_section(d);
    for (const SnapshotOom& o : d.ooms) html += oom_section(o);
  }
  if (!a.notes.empty()) {
    html += "<h2>Notes</h2>\n<ul>";
    for (const std::string& n : a.notes) html += "<li>" + html_escape(n) + "</li>";
    html += "</ul>\n";
  }
  return html + "</body></html>\n";
}

}  // namespace headroom
