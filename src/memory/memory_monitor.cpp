#include "memory/memory_monitor.h"

#include <fmt/format.h>

#include "util/size.h"
#include "util/tensor_bytes.h"

namespace headroom {
namespace {

size_t index_of(Phase p) { return static_cast<size_t>(p) - 1; }

}  // namespace

nlohmann::json Breakdown::to_json() const {
  return {{"weights", weights},         {"gradients", gradients}, {"optimizer", optimizer},
          {"activations", activations}, {"other", other},         {"communication", communication}};
}

nlohmann::json StepMemory::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (Phase p : kStepPhases) {
    const PhaseMemory& m = phases[index_of(p)];
    if (!m.seen) continue;
    j[std::string(phase_name(p))] = {
        {"live_in", m.live_in}, {"live_out", m.live_out}, {"peak", m.peak}, {"breakdown", m.at_peak.to_json()}};
    if (m.peak_reserved >= 0) j[std::string(phase_name(p))]["peak_reserved"] = m.peak_reserved;
  }
  return j;
}

MemoryMonitor::MemoryMonitor(MemoryProbe& probe, TrackedTensors tracked)
    : probe_(probe), tracked_(std::move(tracked)) {}

MemoryMonitor::Scope::~Scope() {
  if (monitor_ == nullptr) return;
  // A destructor must not throw (it may run while an OOM unwinds the step); a phase whose figures
  // cannot be read is left out of the step's record rather than ending the process.
  try {
    monitor_->exit_phase(phase_);
  } catch (...) {
  }
}

void MemoryMonitor::begin_step(int64_t step) {
  if (!enabled_) return;
  step_ = step;
  in_flight_ = StepMemory{};
  in_flight_.step = step + 1;
  const int64_t known =
      storage_bytes(tracked_.weights()) + storage_bytes(tracked_.optimizer()) + storage_bytes(tracked_.gradients());
  probe_.clear_last_oom();  // an OOM diagnosed in this step must be this step's
  last_phase_ = Phase::idle;
  step_start_live_ = probe_.live_bytes();
  other_ = std::max<int64_t>(0, step_start_live_ - known);
}

MemoryMonitor::Scope MemoryMonitor::phase(Phase p) {
  if (!enabled_) return Scope(nullptr, p);
  last_phase_ = p;
  probe_.reset_peak();
  probe_.set_context(step_, p);
  PhaseMemory& m = in_flight_.phases[index_of(p)];
  entry_live_ = probe_.live_bytes();
  if (!m.seen) m.live_in = entry_live_;
  // Kept for a phase whose peak is its entry level (zero_grad): at its exit the tensors that made
  // that peak (the gradients) are gone and could not be named.
  entry_breakdown_ = breakdown_at(entry_live_, std::nullopt, probe_.tagged_bytes());
  return Scope(this, p);
}

void MemoryMonitor::exit_phase(Phase p) {
  PhaseMemory& m = in_flight_.phases[index_of(p)];
  const int64_t peak = probe_.peak_bytes();
  m.live_out = probe_.live_bytes();
  if (!m.seen || peak > m.peak) {
    m.peak = peak;
    m.at_peak =
        peak <= entry_live_ ? entry_breakdown_ : breakdown_at(peak, probe_.peak_sequence(), probe_.peak_tagged_bytes());
  }
  if (const auto st = probe_.allocator_state()) {
    m.peak_reserved = std::max(m.peak_reserved, st->peak_reserved);
    m.reserved_out = st->reserved;
    in_flight_.reserved = st->reserved;
    in_flight_.peak_reserved = std::max(in_flight_.peak_reserved.value_or(0), st->peak_reserved);
    in_flight_.peak_inactive_split = std::max(in_flight_.peak_inactive_split.value_or(0), st->peak_inactive_split);
  }
  if (const auto host = probe_.host_peak_bytes()) in_flight_.host_peak = std::max(in_flight_.host_peak.value_or(0), *host);
  m.seen = true;
  probe_.set_context(step_, Phase::idle);
}

Breakdown MemoryMonitor::breakdown_at(int64_t bytes, std::optional<uint64_t> sequence,
                                      const TaggedBytes& tagged) const {
  Breakdown b;
  b.communication = tagged[AllocationTag::communication];
  // The weights now, with those gathered then in place of those gathered now (--shard full).
  b.weights = storage_bytes(tracked_.weights()) - probe_.tagged_bytes()[AllocationTag::gathered_weights] +
              tagged[AllocationTag::gathered_weights];
  b.optimizer = storage_bytes(tracked_.optimizer());
  std::vector<at::Tensor> grads = tracked_.gradients();
  std::erase_if(grads, [](const at::Tensor& g) { return !g.defined(); });
  if (sequence) {
    // Only gradients that existed at that allocation were part of it.
    std::erase_if(grads, [&](const at::Tensor& g) {
      const auto seq = probe_.sequence_of(g.storage().data());
      return !seq || *seq > *sequence;
    });
  }
  b.gradients = storage_bytes(grads);
  b.other = other_;
  b.activations = std::max<int64_t>(0, bytes - b.weights - b.optimizer - b.gradients - b.other - b.communication);
  return b;
}

StepMemory MemoryMonitor::end_step() {
  if (!enabled_) return {};
  StepMemory out = in_flight_;
  for (Phase p : kStepPhases) {
    const PhaseMemory& m = out.phases[index_of(p)];
    if (!m.seen) continue;
    if (m.peak > out.peak) {
      out.peak = m.peak;
      out.peak_phase = p;
    }
    PhaseRecord& w = worst_[index_of(p)];
    if (!w.memory.seen || m.peak > w.memory.peak) w = {m, out.step};
  }
  step_ = -1;
  probe_.set_context(-1, Phase::idle);
  return out;
}

void MemoryMonitor::abort_step() {
  step_ = -1;
  probe_.set_context(-1, Phase::idle);
}

std::string MemoryMonitor::summary_table() const {
  // The communication column only where there was some (several ranks, on cpu).
  bool communication = false;
  for (const PhaseRecord& r : worst_) communication = communication || r.memory.at_peak.communication > 0;
  std::string out = fmt::format("{:<10} {:>5} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}", "phase", "step", "peak",
                                "weights", "gradients", "optimizer", "activations", "other");
  out += communication ? fmt::format(" {:>13}\n", "communication") : "\n";
  for (Phase p : kStepPhases) {
    const PhaseRecord& r = worst_[index_of(p)];
    if (!r.memory.seen) continue;
    const Breakdown& b = r.memory.at_peak;
    out += fmt::format("{:<10} {:>5} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}", phase_name(p), r.step,
                       format_bytes(r.memory.peak), format_bytes(b.weights), format_bytes(b.gradients),
                       format_bytes(b.optimizer), format_bytes(b.activations), format_bytes(b.other));
    out += communication ? fmt::format(" {:>13}\n", format_bytes(b.communication)) : "\n";
  }
  return out;
}

}  // namespace headroom
