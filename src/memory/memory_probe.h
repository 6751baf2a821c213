// MemoryProbe — live and peak bytes of the device a run trains on, behind one interface.
//
// cpu: the BudgetAllocator's exact counts (installed by make_memory_probe; with caching, its heap's
// statistics as allocator_state()), with per-allocation
// records. cuda: the caching allocator's allocated bytes (device/cuda_adapter.h); per-allocation
// origins (step, phase, size) only while record_origins(true), which costs a little per allocation.
// Peaks are since the last reset_peak().
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "memory/budget_allocator.h"
#include "memory/phase.h"

namespace headroom {

// A caching allocator's state (torch.cuda.memory_stats' names): cuda, or cpu with --allocator caching.
struct AllocatorState {
  int64_t allocated = 0, peak_allocated = 0;  // blocks handed out, at block size
  int64_t reserved = 0, peak_reserved = 0;    // held from the device
  int64_t inactive_split = 0, peak_inactive_split = 0;
  int64_t alloc_retries = 0;
  int64_t ooms = 0;
  bool expandable_segments = false;
};

class MemoryProbe {
 public:
  virtual ~MemoryProbe() = default;
  virtual int64_t live_bytes() const = 0;
  virtual int64_t peak_bytes() const = 0;
  virtual void reset_peak() = 0;

  // Tags allocations with the step and phase they are made in (cuda: while origins are recorded).
  virtual void set_context(int64_t /*step*/, Phase /*phase*/) {}
  // cuda: starts or stops tagging allocations (cpu: always on).
  virtual void record_origins(bool /*enabled*/) {}
  // The allocations alive now with their origin (cpu: every one; cuda: those made while recording);
  // `ptr` is null where the backend does not expose it (cuda).
  virtual std::vector<LiveAllocation> live_allocations() const = 0;
  // Sequence number of the allocation that set the current peak, and of the allocation holding
  // `ptr`; nullopt where the backend keeps no per-allocation records (cuda).
  virtual std::optional<uint64_t> peak_sequence() const { return std::nullopt; }
  virtual std::optional<uint64_t> sequence_of(const void* /*ptr*/) const { return std::nullopt; }
  // Tags the allocations made from now on, by any thread, until changed (memory/allocation_tag.h;
  // cpu: cuda's allocator does not tell them apart, and the monitor counts them as activations).
  virtual void set_tag(AllocationTag /*tag*/) {}
  // Live bytes per tag now, and when the current peak was reached (zeros where not told apart).
  virtual TaggedBytes tagged_bytes() const { return {}; }
  virtual TaggedBytes peak_tagged_bytes() const { return {}; }
  // The host pool's peak since the last reset_peak() (cpu: memory/host_pool.h), where the backend
  // counts one.
  virtual std::optional<int64_t> host_peak_bytes() const { return std::nullopt; }
  // The last refused allocation, where the backend knows it (cpu).
  virtual std::optional<OomEvent> last_oom() const { return std::nullopt; }
  virtual void clear_last_oom() {}

  // Caps the device at `bytes` (cpu: a simulated device; cuda: a memory fraction of the card).
  virtual void set_budget(std::optional<int64_t> bytes) = 0;
  virtual std::optional<int64_t> budget() const = 0;

  // The caching allocator's figures; nullopt where the allocator does not cache (cpu counting).
  // Peaks are since the last reset_peak().
  virtual std::optional<AllocatorState> allocator_state() const { return std::nullopt; }
  // Returns cached blocks that hold no live allocation (cuda: cudaFree; cpu caching: munmap).
  virtual void empty_cache() {}
  // Expandable segments from now on (caching allocators; nothing for the counting one).
  virtual void enable_expandable_segments() {}

  // The allocator's memory snapshot as a pickle pytorch.org/memory_viz opens (cuda: PyTorch's own;
  // cpu caching: the same structure, memory/allocator_snapshot.h). Checks that there is one.
  virtual std::string snapshot_pickle() const;

  // What the figures are, for reports: "cpu (counting allocator)", "cuda:0 (caching allocator)".
  virtual std::string source() const = 0;
};

// cpu: `caching` serves allocations through the caching allocator with `settings`
// (PYTORCH_CUDA_ALLOC_CONF syntax) instead of counting them; cuda: always PyTorch's caching
// allocator, with `settings` applied when not empty.
std::unique_ptr<MemoryProbe> make_memory_probe(const c10::Device& device, bool caching = false,
                                               const std::string& settings = "");

}  // namespace headroom
