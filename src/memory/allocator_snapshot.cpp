#include "memory/allocator_snapshot.h"

#include <fmt/format.h>

namespace headroom {
namespace {

nlohmann::json frames_of(int64_t step, Phase phase) {
  nlohmann::json frames = nlohmann::json::array();
  if (step >= 0) {
    frames.push_back({{"name", fmt::format("step {} {}", step + 1, phase_name(phase))}, {"filename", "headroom"},
                      {"line", 0}});
  }
  return frames;
}

}  // namespace

nlohmann::json allocator_snapshot(const std::vector<SegmentInfo>& segments, const std::vector<HistoryEntry>& history,
                                  const AllocatorConfig& config) {
  nlohmann::json segs = nlohmann::json::array();
  for (const SegmentInfo& s : segments) {
    int64_t allocated = 0, requested = 0;
    nlohmann::json blocks = nlohmann::json::array();
    for (const BlockInfo& b : s.blocks) {
      if (b.allocated) allocated += b.size;
      requested += b.requested;
      blocks.push_back({{"address", b.address},
                        {"size", b.size},
                        {"requested_size", b.requested},
                        {"state", b.allocated ? "active_allocated" : "inactive"},
                        {"frames", nlohmann::json::array()}});
    }
    segs.push_back({{"device", 0},
                    {"address", s.address},
                    {"total_size", s.total_size},
                    {"allocated_size", allocated},
                    {"active_size", allocated},
                    {"requested_size", requested},
                    {"stream", s.stream},
                    {"segment_type", s.small ? "small" : "large"},
                    {"segment_pool_id", {0, 0}},
                    {"is_expandable", s.expandable},
                    {"frames", nlohmann::json::array()},
                    {"blocks", blocks}});
  }
  nlohmann::json trace = nlohmann::json::array();
  for (const HistoryEntry& h : history) {
    nlohmann::json e = {{"action", trace_action_name(h.event.action)},
                        {h.event.action == TraceAction::oom ? "device_free" : "addr", h.event.address},
                        {"size", h.event.size},
                        {"stream", h.event.stream},
                        {"time_us", h.time_us}};
    if (h.step >= 0) e["frames"] = frames_of(h.step, h.phase);
    trace.push_back(std::move(e));
  }
  nlohmann::json roundup = nlohmann::json::object();
  for (int i = 0; i < kRoundupIntervals; ++i) roundup[std::to_string(int64_t{1} << i)] = config.roundup_power2_divisions[i];
  const nlohmann::json settings = {
      {"PYTORCH_CUDA_ALLOC_CONF", config.text()},
      {"max_split_size", config.max_split_size == std::numeric_limits<int64_t>::max() ? int64_t{-1} : config.max_split_size},
      {"garbage_collection_threshold", config.garbage_collection_threshold},
      {"expandable_segments", config.expandable_segments},
      {"roundup_power2_divisions", roundup}};
  return {{"segments", segs},
          {"device_traces", nlohmann::json::array({trace})},
          {"allocator_settings", settings},
          {"external_annotations", nlohmann::json::array()}};
}

}  // namespace headroom
