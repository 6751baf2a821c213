#include "memory/leak_detector.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "util/size.h"
#include "util/stats.h"

namespace headroom {

nlohmann::json LeakVerdict::to_json() const {
  nlohmann::json s = nlohmann::json::array();
  for (const LeakSite& x : sites) {
    s.push_back({{"phase", x.phase},
                 {"bytes", x.bytes},
                 {"count", x.count},
                 {"steps", x.steps},
                 {"description", x.description}});
    if (!x.origin.empty()) s.back()["origin"] = x.origin;
  }
  return {{"detected", detected},   {"bytes_per_step", bytes_per_step},
          {"monotonic", monotonic}, {"steps_used", steps_used},
          {"reason", reason},       {"sites", s}};
}

LeakVerdict judge_growth(const std::vector<StepLive>& all, const LeakOptions& o) {
  LeakVerdict v;
  std::vector<StepLive> steps;
  for (const StepLive& s : all) {
    if (s.step > o.warmup_steps) steps.push_back(s);
  }
  v.steps_used = static_cast<int64_t>(steps.size());
  if (v.steps_used < o.min_steps) {
    v.reason = fmt::format("{} steps after the {} warm-up steps; {} needed for a verdict", v.steps_used, o.warmup_steps,
                           o.min_steps);
    return v;
  }
  std::vector<double> slopes, transients;
  int64_t not_down = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    transients.push_back(static_cast<double>(steps[i].transient));
    if (i > 0 && steps[i].live_after >= steps[i - 1].live_after) ++not_down;
    for (size_t j = i + 1; j < steps.size(); ++j) {
      slopes.push_back(static_cast<double>(steps[j].live_after - steps[i].live_after) /
                       static_cast<double>(steps[j].step - steps[i].step));
    }
  }
  v.bytes_per_step = median(slopes);
  v.monotonic = static_cast<double>(not_down) / static_cast<double>(steps.size() - 1);
  const double threshold = std::max(1.0, o.relative_threshold * median(transients));
  v.detected = v.bytes_per_step > threshold && v.monotonic >= o.min_monotonic;
  v.reason = fmt::format(
      "live memory after each step changes by {} per step (median of pairwise slopes over {} steps, "
      "{:.0f}% of steps not shrinking); the threshold is {} (1% of a step's transient {})",
      format_bytes(static_cast<int64_t>(v.bytes_per_step)), v.steps_used, 100 * v.monotonic,
      format_bytes(static_cast<int64_t>(threshold)), format_bytes(static_cast<int64_t>(median(transients))));
  return v;
}

std::vector<LeakSite> leak_sites(const std::vector<LiveAllocation>& live, int64_t warmup_steps, int64_t last_step,
                                 const OriginName& origin_name) {
  struct Group {
    int64_t count = 0;
    std::set<int64_t> steps;
  };
  std::map<std::tuple<Phase, int64_t, uint32_t>, Group> groups;
  for (const LiveAllocation& a : live) {
    const AllocationRecord& r = a.record;
    if (r.step < warmup_steps || r.step >= last_step) continue;
    Group& g = groups[{r.phase, r.bytes, origin_name ? r.origin : 0}];
    ++g.count;
    g.steps.insert(r.step);
  }
  const int64_t span = std::max<int64_t>(1, last_step - warmup_steps);
  std::vector<LeakSite> out;
  for (const auto& [key, g] : groups) {
    LeakSite s;
    s.phase = std::string(phase_name(std::get<0>(key)));
    s.bytes = std::get<1>(key);
    if (std::get<2>(key) != 0) s.origin = origin_name(std::get<2>(key));
    s.count = g.count;
    s.steps = static_cast<int64_t>(g.steps.size());
    const std::string when = s.steps >= span ? "every step" : fmt::format("{} of {} steps", s.steps, span);
    s.description =
        fmt::format("{} allocation{} of {} created during {} of {}{} and never freed", s.count, s.count == 1 ? "" : "s",
                    format_bytes(s.bytes), s.phase, when, s.origin.empty() ? "" : " at " + s.origin);
    out.push_back(s);
  }
  std::sort(out.begin(), out.end(),
            [](const LeakSite& a, const LeakSite& b) { return a.bytes * a.count > b.bytes * b.count; });
  return out;
}

}  // namespace headroom
