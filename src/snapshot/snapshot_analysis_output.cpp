// SnapshotAnalysis as JSON (the CLI's --json) and as the text report.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "snapshot/snapshot_analysis.h"
#include "util/size.h"

namespace headroom {
namespace {

nlohmann::json groups_json(const std::vector<SiteGroup>& groups) {
  nlohmann::json out = nlohmann::json::array();
  for (const SiteGroup& g : groups) {
    out.push_back({{"site", g.site}, {"callers", g.callers}, {"bytes", g.bytes}, {"count", g.count}});
  }
  return out;
}

nlohmann::json timeline_json(const DeviceAnalysis& d) {
  nlohmann::json timeline = nlohmann::json::array();
  for (const TimelineBucket& t : d.timeline) {
    timeline.push_back({{"event", t.first_event},
                        {"time_us", t.time_us},
                        {"allocated_min", t.allocated_min},
                        {"allocated_max", t.allocated_max},
                        {"reserved_max", t.reserved_max}});
  }
  return timeline;
}

nlohmann::json iterations_json(const DeviceAnalysis& d) {
  nlohmann::json its = nlohmann::json::array();
  for (const Iteration& i : d.iterations) {
    its.push_back(
        {{"event", i.first_event}, {"time_us", i.time_us}, {"live_at_start", i.live_at_start}, {"peak", i.peak}});
  }
  return {{"found", d.iterations_found}, {"how", d.iterations_reason}, {"list", its}};
}

nlohmann::json fragmentation_json(const DeviceAnalysis& d) {
  nlohmann::json segs = nlohmann::json::array();
  for (const SegmentState& s : d.fragmented_segments) {
    segs.push_back({{"address", s.address},
                    {"total_size", s.total},
                    {"allocated", s.allocated},
                    {"inactive_split", s.inactive_split},
                    {"segment_type", s.small ? "small" : "large"}});
  }
  nlohmann::json replays = nlohmann::json::array();
  for (const PolicyReplay& p : d.replays) {
    replays.push_back({{"setting", p.setting},
                       {"peak_reserved", p.peak_reserved},
                       {"peak_allocated", p.peak_allocated},
                       {"saving", p.saving}});
  }
  return {{"verdict", d.fragmentation},
          {"inactive_split_at_peak", d.inactive_split_at_peak},
          {"free_segments_at_peak", d.free_segments_at_peak},
          {"segments_at_peak", segs},
          {"empty_cache_returns", d.empty_cache_at_end},
          {"replays", replays},
          {"timeline", timeline_json(d)}};
}

nlohmann::json ooms_json(const DeviceAnalysis& d) {
  nlohmann::json ooms = nlohmann::json::array();
  for (const SnapshotOom& o : d.ooms) {
    nlohmann::json levers = nlohmann::json::array();
    for (const OomLever& l : o.levers) {
      levers.push_back(
          {{"lever", l.lever}, {"setting", l.setting}, {"bytes", l.bytes}, {"avoids", l.avoids}, {"note", l.note}});
    }
    ooms.push_back({{"event", o.event},
                    {"time_us", o.time_us},
                    {"requested", o.requested},
                    {"allocated", o.allocated},
                    {"reserved", o.reserved},
                    {"cached", o.cached},
                    {"device_free", o.device_free},
                    {"shortfall", o.shortfall},
                    {"site", o.stack},
                    {"live", groups_json(o.live)},
                    {"levers", levers}});
  }
  return ooms;
}

nlohmann::json device_json(const DeviceAnalysis& d) {
  return {
      {"device", d.device},
      {"events", d.events},
      {"segments", d.segments},
      {"history", d.has_history},
      {"peak",
       {{"allocated", d.peak_allocated},
        {"allocated_event", d.peak_allocated_event},
        {"allocated_time_us", d.peak_allocated_time_us},
        {"reserved", d.peak_reserved},
        {"reserved_event", d.peak_reserved_event},
        {"reserved_time_us", d.peak_reserved_time_us},
        {"live", groups_json(d.live_at_peak)}}},
      {"start", {{"allocated", d.allocated_at_start}, {"reserved", d.reserved_at_start}}},
      {"end", {{"allocated", d.allocated_at_end}, {"reserved", d.reserved_at_end}}},
      {"iterations", iterations_json(d)},
      {"leak", d.leak.to_json()},
      {"fragmentation", fragmentation_json(d)},
      {"ooms", ooms_json(d)},
  };
}

}  // namespace

nlohmann::json SnapshotAnalysis::to_json() const {
  nlohmann::json devs = nlohmann::json::array();
  for (const DeviceAnalysis& d : devices) devs.push_back(device_json(d));
  return {{"source", source},
          {"allocator_settings",
           {{"conf", settings.conf},
            {"expandable_segments", settings.expandable_segments},
            {"max_split_size", settings.max_split_size}}},
          {"devices", devs},
          {"notes", notes}};
}

std::string SnapshotAnalysis::text() const {
  std::string t = fmt::format("headroom analyze: {}\n", source);
  for (const DeviceAnalysis& d : devices) {
    t += fmt::format("\ndevice {}: {} segments, {} trace events\n", d.device, d.segments, d.events);
    t += fmt::format("1. peak allocated {} (event {}), peak reserved {} (event {})\n", format_bytes(d.peak_allocated),
                     d.peak_allocated_event, format_bytes(d.peak_reserved), d.peak_reserved_event);
    t += "   live at the peak, by the code that allocated it:\n";
    for (const SiteGroup& g : d.live_at_peak) {
      t += fmt::format("   {:>12}  {:>6}  {}{}\n", format_bytes(g.bytes), g.count ? std::to_string(g.count) : "",
                       g.site, g.callers.empty() ? "" : "  <- " + g.callers.front());
    }
    t += fmt::format("2. iterations: {}\n", d.iterations_reason);
    if (d.iterations_found) {
      const size_t show = std::min<size_t>(d.iterations.size(), 8);
      for (size_t k = 0; k < show; ++k) {
        t += fmt::format("   iteration {}: live at start {}, peak {}\n", k + 1,
                         format_bytes(d.iterations[k].live_at_start), format_bytes(d.iterations[k].peak));
      }
      if (show < d.iterations.size()) t += fmt::format("   ... {} more\n", d.iterations.size() - show);
      t += fmt::format("   leak: {} — {}\n", d.leak.detected ? "detected" : "none", d.leak.reason);
      for (const LeakSite& s : d.leak.sites) t += "   - " + s.description + "\n";
    }
    t += "10. fragmentation: " + d.fragmentation + "\n";
    for (const PolicyReplay& p : d.replays) {
      t += fmt::format("   replay {}: peak reserved {}{}\n", p.setting, format_bytes(p.peak_reserved),
                       p.saving != 0
                           ? fmt::format(" ({} {})", p.saving > 0 ? "saves" : "costs", format_bytes(std::abs(p.saving)))
                           : "");
    }
    for (const SnapshotOom& o : d.ooms) {
      t += fmt::format(
          "OOM at event {}: asked for {} at {}; {} live, {} reserved ({} cached), device free {}, short by {}\n",
          o.event, format_bytes(o.requested), o.stack, format_bytes(o.allocated), format_bytes(o.reserved),
          format_bytes(o.cached), o.device_free >= 0 ? format_bytes(o.device_free) : "unknown",
          format_bytes(o.shortfall));
      for (const OomLever& l : o.levers) {
        t += fmt::format("   {} ({}): {} — {}; {}\n", l.lever, l.setting, format_bytes(l.bytes),
                         l.avoids ? "would have avoided it" : "not enough", l.note);
      }
    }
  }
  for (const std::string& n : notes) t += "note: " + n + "\n";
  return t;
}

}  // namespace headroom
