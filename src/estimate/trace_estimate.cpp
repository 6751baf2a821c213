#include "estimate/trace_estimate.h"

#include <algorithm>
#include <unordered_map>

#include "estimate/cuda_workspace.h"
#include "memory/caching_policy.h"
#include "util/error.h"

namespace headroom {

Estimate estimate_traced(const TracedStep& step) {
  sim::Memory mem;
  std::vector<int> label_ids;
  label_ids.reserve(step.labels.size());
  for (const sim::Label& l : step.labels) label_ids.push_back(mem.label(l.name, l.category, l.formula));
  if (step.cuda) {
    mem.set_rounding(kMinBlockSize, mem.label("allocator rounding", sim::Category::allocator,
                                              "each block rounded up to 512 bytes, as the caching allocator does"));
  }
  std::unordered_map<int64_t, sim::Ref> live;
  sim::Ref workspace;
  size_t step_begin_event = 0;
  // At the step's start: on cuda, cuBLAS's workspace, taken at its first matmul and kept (made
  // before the step, as the native estimate makes it, so every phase's peak holds it).
  const auto begin_step = [&] {
    if (step.cuda) {
      workspace = mem.allocate(kCublasWorkspaceBytes,
                               mem.label("cuBLAS workspace", sim::Category::allocator, kCublasWorkspaceFormula));
    }
    step_begin_event = mem.events().size();
  };
  const size_t begin = std::min(step.step_begin, step.events.size());
  for (size_t i = 0; i < step.events.size(); ++i) {
    if (i == begin) begin_step();
    const TracedEvent& e = step.events[i];
    if (e.phase != mem.phase()) {
      // The step runner enters the optimizer's phase between backward and zero_grad; an update
      // that allocates and frees nothing (plain SGD on cpu) leaves no event of it, and its peak is
      // what is live as it runs.
      if (mem.phase() == Phase::backward && e.phase == Phase::zero_grad) mem.set_phase(Phase::optimizer);
      mem.set_phase(e.phase);
    }
    if (e.allocated) {
      if (e.label < 0 || static_cast<size_t>(e.label) >= label_ids.size()) {
        fail("trace: event {} names label {} of {}", i, e.label, label_ids.size());
      }
      if (e.bytes < 0) fail("trace: event {} allocates {} bytes", i, e.bytes);
      live[e.storage] = mem.allocate(e.bytes, label_ids[static_cast<size_t>(e.label)]);
    } else {
      live.erase(e.storage);
    }
  }
  if (begin == step.events.size()) begin_step();

  Estimate est;
  est.cuda = step.cuda;
  est.model = step.model;
  est.params = step.params;
  const auto& peak = mem.peak();
  est.peak_bytes = peak.bytes;
  est.peak_phase = peak.phase;
  est.phase_peaks = mem.phase_peaks();
  const auto& labels = mem.labels();
  for (size_t i = 0; i < labels.size(); ++i) {
    const int64_t bytes = i < peak.by_label.size() ? peak.by_label[i] : 0;
    est.breakdown[static_cast<size_t>(labels[i].category)] += bytes;
    if (bytes > 0) est.items.push_back({labels[i].name, labels[i].category, bytes, labels[i].formula});
  }
  std::stable_sort(est.items.begin(), est.items.end(),
                   [](const EstimateItem& a, const EstimateItem& b) { return a.bytes > b.bytes; });
  // The trace holds whole steps (the any-model path records two): played once after the setup.
  est.reserved = replay_reserved(mem.events(), step_begin_event, 1, step.caching);
  return est;
}

}  // namespace headroom
