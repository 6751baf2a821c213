// headroom_allocator_replay — run by scripts/gpu-check on a GPU machine: the same allocation traces
// through PyTorch's real CUDA caching allocator and through headroom's CachingPolicy, comparing
// reserved bytes after every event. Traces: a seeded random one (sizes from 512 bytes to 30 MiB,
// small and large pools), and one recorded from a cpu caching-allocator training run (gpt2's widths,
// two layers, three steps). Each with the default settings and with expandable_segments:True.
// Prints one JSON object per trace and setting. Exit 0: every trace agrees at every event;
// 1: some differ (listed); 2: no GPU here.
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "device/cuda_adapter.h"
#include "memory/budget_allocator.h"
#include "memory/caching_policy.h"
#include "train/trainer.h"

using namespace headroom;

namespace {

struct Event {
  bool alloc = true;
  uint64_t key = 0;
  int64_t bytes = 0;
};

std::vector<Event> random_trace() {
  std::mt19937 rng(7);
  std::vector<Event> out;
  std::vector<uint64_t> live;
  for (uint64_t key = 1; key <= 3000; ++key) {
    const int64_t bytes = rng() % 3 == 0 ? 1 + static_cast<int64_t>(rng() % (30 << 20))
                                         : 1 + static_cast<int64_t>(rng() % (900 << 10));
    out.push_back({true, key, bytes});
    live.push_back(key);
    if (live.size() > 40) {
      const size_t i = rng() % live.size();
      out.push_back({false, live[i], 0});
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  return out;
}

std::vector<Event> recorded_trace() {
  BudgetAllocator& a = BudgetAllocator::install();
  a.record_history(2'000'000);
  RunConfig cfg;
  cfg.model = "gpt2";
  cfg.overrides = {"n_layer=2"};
  cfg.device = "cpu";
  cfg.steps = 3;
  cfg.batch = 2;
  cfg.seq = 32;
  cfg.eval_rows = 0;
  cfg.quiet = true;
  cfg.allocator = AllocatorKind::caching;
  cfg.allocator_conf = "backend:native";
  train(cfg);
  std::vector<Event> out;
  for (const HistoryEntry& h : a.history()) {
    if (h.event.action == TraceAction::alloc) out.push_back({true, h.event.address, h.event.size});
    if (h.event.action == TraceAction::free_requested) out.push_back({false, h.event.address, 0});
  }
  a.record_history(0);
  return out;
}

nlohmann::json replay(const std::vector<Event>& trace, const std::string& settings) {
  cuda_set_allocator_settings(settings.empty() ? "expandable_segments:False" : settings);
  cuda_empty_cache();
  cuda_reset_peak_stats(0);
  const int64_t base = cuda_memory_stats(0).reserved_bytes;
  CachingPolicy policy(parse_allocator_config(settings, "replay"));
  std::unordered_map<uint64_t, std::shared_ptr<void>> cuda_live;
  std::unordered_map<uint64_t, uint64_t> policy_live;
  int64_t mismatched = 0, max_diff = 0, first_mismatch = -1;
  for (size_t i = 0; i < trace.size(); ++i) {
    const Event& e = trace[i];
    if (e.alloc) {
      cuda_live[e.key] = cuda_allocate_block(e.bytes);
      policy_live[e.key] = *policy.allocate(e.bytes);
    } else {
      cuda_live.erase(e.key);
      policy.free(policy_live.at(e.key));
      policy_live.erase(e.key);
    }
    const int64_t diff = cuda_memory_stats(0).reserved_bytes - base - policy.stats().reserved_bytes.current;
    if (diff != 0) {
      if (first_mismatch < 0) first_mismatch = static_cast<int64_t>(i);
      ++mismatched;
      max_diff = std::max(max_diff, std::abs(diff));
    }
  }
  const CudaMemoryStats st = cuda_memory_stats(0);
  nlohmann::json j = {{"settings", settings.empty() ? "default" : settings},
                      {"events", trace.size()},
                      {"mismatched_events", mismatched},
                      {"first_mismatch", first_mismatch},
                      {"max_abs_difference_bytes", max_diff},
                      {"peak_reserved_cuda", st.peak_reserved_bytes - base},
                      {"peak_reserved_policy", policy.stats().reserved_bytes.peak},
                      {"peak_allocated_cuda", st.peak_allocated_bytes},
                      {"peak_allocated_policy", policy.stats().allocated_bytes.peak}};
  cuda_live.clear();
  cuda_empty_cache();
  return j;
}

}  // namespace

int main() {
  if (!cuda_available()) {
    fmt::print(stderr, "headroom_allocator_replay: no CUDA device here\n");
    return 2;
  }
  cuda_init();
  int status = 0;
  const std::vector<std::pair<std::string, std::vector<Event>>> traces = {{"random", random_trace()},
                                                                         {"gpt2-2-layers-cpu", recorded_trace()}};
  for (const auto& [name, trace] : traces) {
    for (const std::string settings : {"", "expandable_segments:True"}) {
      nlohmann::json j = replay(trace, settings);
      j["trace"] = name;
      if (j["mismatched_events"].get<int64_t>() != 0) status = 1;
      fmt::print("{}\n", j.dump());
      std::fflush(stdout);
    }
  }
  return status;
}
