// BudgetAllocator — LibTorch's CPU allocator, counted, and optionally capped like a device.
//
// Installed once per process as the CPU allocator (c10::SetCPUAllocator), it wraps the allocator it
// replaces: every CPU tensor allocation passes through it, so live and peak bytes are exact for
// everything that allocates through c10's current CPU allocator (all of ATen's tensor factories).
// Known gaps, shown by tests in budget_allocator_test.cpp: code that calls
// c10::GetDefaultCPUAllocator() directly; TensorImpl and other metadata on the C++ heap; tensors
// wrapping foreign memory (at::from_blob); and scratch that oneDNN or a BLAS takes with malloc inside
// an operator. Pinned host memory exists only in CUDA builds with a GPU, where it comes from CUDA's
// host allocator, not from this one.
//
// With a budget it behaves like a device of that size: an allocation that would take live bytes
// past the budget throws c10::OutOfMemoryError with a message in the style of CUDA's, naming the
// step and phase, and nothing is allocated. Fault injection fails the N-th allocation after arming,
// or the first one above a size, the same way — deterministic, for tests of OOM handling.
//
// Two ways to get memory. Counting (the default): each allocation goes to the allocator it wraps,
// and the budget caps live bytes. Caching (use_caching): each is served by a CachingHeap, PyTorch's
// CUDA caching allocator reproduced over host memory, and the budget caps *reserved* bytes, as a
// card does: an OOM can then come from fragmentation, and caching_stats() has torch.cuda's
// allocated, reserved, active, inactive-split, retries and OOMs. Live and peak bytes stay what
// tensors asked for in both. Switching leaves earlier blocks where they were allocated.
//
// A second pool, host memory (optimizer offload, optim/offload.h): while set_pool(host) is in force,
// allocations are counted apart — host_live_bytes(), host_peak_bytes() — never against the budget,
// never served by the caching heap, never failed by injection, and not among live_allocations():
// the simulated device is what the rest of the allocator describes.
//
// Each live allocation has a record: size, a sequence number (the allocation count when it was
// made), the step and phase it was made in, and, when enabled, a short native backtrace. Counters
// are atomic, records sit behind a mutex; allocate and free may be called from any thread. The
// context (step, phase) is process-wide: one training loop at a time.
#pragma once

#include <c10/core/Allocator.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "memory/allocation_tag.h"
#include "memory/caching_heap.h"
#include "memory/phase.h"

namespace headroom {

inline constexpr int kMaxFrames = 12;

enum class MemoryPool : uint8_t { device, host };

struct AllocationRecord {
  int64_t bytes = 0;
  uint64_t sequence = 0;
  int64_t step = -1;
  Phase phase = Phase::idle;
  int frames = 0;  // entries of `stack` in use (0 unless backtraces are on)
  std::array<void*, kMaxFrames> stack{};
  CachingHeap* heap = nullptr;  // the heap that served it (caching), else null
  AllocationTag tag = AllocationTag::none;  // set_tag() when it was made
  uint32_t origin = 0;                      // the origin source's id of where it was made (0: none; set_origin_source)
};

struct LiveAllocation {
  const void* ptr = nullptr;
  AllocationRecord record;
};

// The allocation that failed: real (over budget) or injected.
struct OomEvent {
  int64_t requested = 0;
  int64_t live = 0;    // bytes in use when it failed
  int64_t budget = -1; // -1: none
  int64_t step = -1;
  Phase phase = Phase::idle;
  uint64_t sequence = 0;  // allocations made before it
  TaggedBytes tagged;     // of `live`, the tagged allocations' bytes
  bool injected = false;
  std::optional<CachingOom> caching;  // the caching allocator's state when it refused
};

// One event of the caching allocator's history, with the step and phase it happened in and its
// time since the history began.
struct HistoryEntry {
  TraceEvent event;
  int64_t time_us = 0;
  int64_t step = -1;
  Phase phase = Phase::idle;
};

class BudgetAllocator final : public c10::Allocator {
 public:
  // Installs the process-wide instance on first call (wrapping the current CPU allocator) and
  // returns it. Tensors allocated before installation are not counted, before or after.
  static BudgetAllocator& install();
  // The process-wide instance when installed, else null.
  static BudgetAllocator* installed();

  c10::DataPtr allocate(size_t bytes) override;
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t live_bytes() const { return live_.load(std::memory_order_relaxed); }
  int64_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  // Allocations made so far; also the sequence number of the latest.
  uint64_t allocation_count() const { return count_.load(std::memory_order_relaxed); }
  // The sequence number of the allocation that reached the current peak.
  uint64_t peak_sequence() const { return peak_seq_.load(std::memory_order_relaxed); }
  // Peak restarts from the current live bytes (the host pool's too).
  void reset_peak();

  // Where later allocations go, from any thread, until changed (memory/host_pool.h scopes it).
  void set_pool(MemoryPool pool) { pool_.store(static_cast<uint8_t>(pool), std::memory_order_relaxed); }
  MemoryPool pool() const { return static_cast<MemoryPool>(pool_.load(std::memory_order_relaxed)); }
  int64_t host_live_bytes() const { return host_live_.load(std::memory_order_relaxed); }
  int64_t host_peak_bytes() const { return host_peak_.load(std::memory_order_relaxed); }

  // nullopt: unlimited. A budget below the current live bytes only refuses new allocations. The
  // budget and fault injection apply only while accounting is on.
  void set_budget(std::optional<int64_t> bytes);
  std::optional<int64_t> budget() const;

  // Tags later allocations (records, OOM messages).
  void set_context(int64_t step, Phase phase);
  int64_t context_step() const { return step_.load(std::memory_order_relaxed); }
  // Tags later allocations, from any thread (a collective's own worker too), until changed
  // (memory/allocation_tag.h); their live bytes are counted apart by tag, now and at the peak.
  void set_tag(AllocationTag tag) { tag_.store(static_cast<uint8_t>(tag), std::memory_order_relaxed); }
  AllocationTag tag() const { return static_cast<AllocationTag>(tag_.load(std::memory_order_relaxed)); }
  TaggedBytes tagged_bytes() const;
  TaggedBytes peak_tagged_bytes() const;
  Phase context_phase() const { return static_cast<Phase>(phase_.load(std::memory_order_relaxed)); }

  // Fault injection, one-shot: the n-th allocation from now (n >= 1) fails, or the first larger
  // than `bytes`. Arming one disarms the other.
  void fail_nth_allocation(int64_t n);
  void fail_allocation_above(int64_t bytes);
  void disarm();

  // Accounting off: allocations pass straight to the wrapped allocator, uncounted and unrecorded
  // (for measuring the accounting's own cost). Budget and injection need it on.
  void set_accounting(bool on) { accounting_.store(on); }
  // Record a native backtrace with each allocation (costs a few microseconds each).
  void set_backtraces(bool on) { backtraces_.store(on); }
  // Where each allocation was made, in the caller's terms: `source` (null: off) runs on the
  // allocating thread, outside the allocator's lock, and returns an id its owner can name (the
  // Python module: the user's file and line), kept in the allocation's record.
  using OriginSource = uint32_t (*)();
  void set_origin_source(OriginSource source) { origin_source_.store(source); }

  // Caching: later allocations come from a new CachingHeap with these settings (the cached memory
  // of the previous one is returned); nullopt: back to counting.
  void use_caching(std::optional<AllocatorConfig> config);
  bool caching() const { return caching_.load(std::memory_order_relaxed); }
  // Caching only (nullopt when counting): the heap's statistics, its segments, its settings.
  std::optional<CachingStats> caching_stats() const;
  std::vector<SegmentInfo> caching_segments() const;
  std::optional<AllocatorConfig> caching_config() const;
  // Changes the settings of the current heap in place, as PyTorch's setAllocatorSettings does
  // (blocks already cut stay as they are).
  void set_caching_config(const AllocatorConfig& config);
  // Returns cached blocks that hold no live allocation (caching; nothing when counting).
  void empty_cache();
  // Records the caching heap's events, keeping the latest `max_entries` (off: 0, which clears).
  void record_history(size_t max_entries);
  std::vector<HistoryEntry> history() const;

  std::optional<AllocationRecord> record_of(const void* ptr) const;
  std::vector<LiveAllocation> live_allocations() const;
  std::optional<OomEvent> last_oom() const;
  void clear_last_oom();
  // Allocation counts by size class: entry k counts sizes in (2^(k-1), 2^k].
  std::array<int64_t, 48> size_histogram() const;

 private:
  explicit BudgetAllocator(c10::Allocator* inner) : inner_(inner) {}
  static void release(void* ptr);
  void on_free(void* ptr);
  AllocationRecord new_record(int64_t bytes) const;  // size, context, tag, backtrace, origin
  [[noreturn]] void refuse(int64_t bytes, int64_t live, int64_t cap, bool injected,
                           std::optional<CachingOom> caching = std::nullopt);
  std::optional<c10::DataPtr> allocate_cached(int64_t bytes);
  c10::DataPtr allocate_host(size_t bytes);  // nullopt: no heap (caching just switched off)
  void observe(const TraceEvent& e);  // under mutex_
  void record(void* ptr, AllocationRecord rec);  // under mutex_: the record, count, histogram, peak

  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_deleter_ = nullptr;
  mutable std::mutex mutex_;
  std::unordered_map<const void*, AllocationRecord> records_;  // live allocations
  std::unordered_map<const void*, int64_t> host_records_;      // live host-pool allocations, their bytes
  std::array<int64_t, 48> histogram_{};
  std::optional<OomEvent> last_oom_;
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> peak_seq_{0};
  TaggedBytes tagged_, peak_tagged_;  // under mutex_: live tagged bytes, now and when the peak was reached
  std::atomic<uint8_t> tag_{0};
  std::atomic<uint8_t> pool_{0};
  std::atomic<int64_t> host_live_{0};
  std::atomic<int64_t> host_peak_{0};
  std::atomic<int64_t> budget_{-1};
  std::atomic<int64_t> step_{-1};
  std::atomic<uint8_t> phase_{0};
  std::atomic<int64_t> fail_countdown_{0};  // > 0: armed
  std::atomic<int64_t> fail_above_{-1};     // >= 0: armed
  std::atomic<bool> accounting_{true};
  std::atomic<bool> backtraces_{false};
  std::atomic<OriginSource> origin_source_{nullptr};
  std::atomic<bool> caching_{false};
  std::unique_ptr<CachingHeap> heap_;                  // caching: the current heap
  std::vector<std::unique_ptr<CachingHeap>> retired_;  // earlier heaps with live blocks
  size_t history_max_ = 0;
  std::vector<HistoryEntry> history_;  // a ring of history_max_ entries once full
  size_t history_next_ = 0;
  int64_t history_start_us_ = 0;
};

}  // namespace headroom
