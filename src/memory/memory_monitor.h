// MemoryMonitor — per step and per phase: live bytes at entry and exit, the peak inside, and what
// the peak consisted of (weights, gradients, optimizer state, activations and temporaries, other,
// and with several ranks the collectives' buffers, which the probe tells apart on cpu, as it does
// weights gathered from the ranks' slices and let go before the phase's end).
//
// The trainer opens one scope per phase (`auto s = monitor.phase(Phase::forward);`); a phase entered
// several times in a step (micro-batches) is merged: first entry, last exit, highest peak. The
// breakdown names the tensors it is told about (TrackedTensors), storage shared between tensors
// counted once; "other" is what was live at the step's start and is none of those (the dataset,
// caches); "activations" is the rest of the peak — saved activations and temporaries. On cpu a
// gradient counts at a peak only if it was allocated before it (allocation sequence numbers); on
// cuda every gradient alive at the phase's end counts. With a caching allocator (cuda, cpu caching)
// each phase and step also records reserved bytes, from the probe's allocator_state(). Not
// thread-safe; one per training loop.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "memory/memory_probe.h"
#include "memory/phase.h"

namespace headroom {

struct Breakdown {
  int64_t weights = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;
  int64_t activations = 0;  // and temporaries
  int64_t other = 0;
  int64_t communication = 0;  // data parallel: the collectives' buffers (cpu; cuda counts them as activations)
  int64_t total() const { return weights + gradients + optimizer + activations + other + communication; }
  nlohmann::json to_json() const;
};

struct TrackedTensors {
  std::function<std::vector<at::Tensor>()> weights;
  std::function<std::vector<at::Tensor>()> gradients;  // the defined ones, now
  std::function<std::vector<at::Tensor>()> optimizer;
};

struct PhaseMemory {
  bool seen = false;
  int64_t live_in = 0;
  int64_t live_out = 0;
  int64_t peak = 0;
  Breakdown at_peak;
  // A caching allocator's reserved bytes (-1: the allocator does not cache): the highest inside the
  // phase, and at its exit.
  int64_t peak_reserved = -1;
  int64_t reserved_out = -1;
};

struct StepMemory {
  int64_t step = 0;  // 1-based, as in the metrics
  std::array<PhaseMemory, kStepPhases.size()> phases;
  int64_t peak = 0;
  Phase peak_phase = Phase::idle;
  // A caching allocator's (cuda, cpu caching): reserved bytes after the step and the step's highest,
  // and the most free bytes inside split segments (inactive split) in it.
  std::optional<int64_t> reserved, peak_reserved, peak_inactive_split;
  // Where the probe has a host pool (the budget allocator's): its highest over the step's phases.
  std::optional<int64_t> host_peak;
  nlohmann::json to_json() const;  // {"forward": {"live_in", "live_out", "peak", "breakdown"}, ...}
};

class MemoryMonitor {
 public:
  MemoryMonitor(MemoryProbe& probe, TrackedTensors tracked);

  // Closes the phase on destruction.
  class Scope {
   public:
    Scope(Scope&& other) noexcept : monitor_(other.monitor_), phase_(other.phase_) { other.monitor_ = nullptr; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope();

   private:
    friend class MemoryMonitor;
    Scope(MemoryMonitor* m, Phase p) : monitor_(m), phase_(p) {}
    MemoryMonitor* monitor_;
    Phase phase_;
  };

  // Off: phases, steps and their records are not taken (no probe is read or reset), for a caller
  // that measures the device itself (the static-graph trial). On by default.
  void set_enabled(bool on) { enabled_ = on; }

  // `step` is 0-based (the index of the optimizer step about to run).
  void begin_step(int64_t step);
  [[nodiscard]] Scope phase(Phase p);
  StepMemory end_step();
  // Abandons the step in flight (after an OOM); the phase scopes have already closed.
  void abort_step();

  // The phase entered last (still set after an exception closed it: where an OOM happened).
  Phase last_phase() const { return last_phase_; }
  int64_t step_start_live() const { return step_start_live_; }
  int64_t current_step() const { return step_; }

  // What `bytes` in use consisted of at the allocation with sequence number `sequence` (nullopt:
  // now), `tagged` of them tagged then (the collectives' buffers, weights gathered for a while:
  // memory/allocation_tag.h). Valid inside a step.
  Breakdown breakdown_at(int64_t bytes, std::optional<uint64_t> sequence, const TaggedBytes& tagged) const;

  // Per phase, the highest peak seen over all completed steps, with its breakdown and step.
  struct PhaseRecord {
    PhaseMemory memory;
    int64_t step = 0;
  };
  const std::array<PhaseRecord, kStepPhases.size()>& worst() const { return worst_; }
  // A table in the spirit of torch.cuda.memory_summary(): peak per phase, by category.
  std::string summary_table() const;

 private:
  void exit_phase(Phase p);

  MemoryProbe& probe_;
  TrackedTensors tracked_;
  bool enabled_ = true;
  int64_t step_ = -1;
  Phase last_phase_ = Phase::idle;
  int64_t other_ = 0;
  int64_t step_start_live_ = 0;
  int64_t entry_live_ = 0;
  Breakdown entry_breakdown_;
  StepMemory in_flight_;
  std::array<PhaseRecord, kStepPhases.size()> worst_{};
};

}  // namespace headroom
