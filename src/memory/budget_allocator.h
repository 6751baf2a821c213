// BudgetAllocator — LibTorch's CPU allocator, counted, and optionally capped like a device.
//
// Installed once per process as the CPU allocator (c10::SetCPUAllocator), it wraps the allocator it
// replaces: every CPU tensor allocation passes through it, so live and peak bytes are exact for
// everything that allocates through c10 (not: memory oneDNN or BLAS take with malloc internally).
// With a budget it behaves like a device of that size: an allocation that would take live bytes
// past the budget throws c10::OutOfMemoryError with a message in the style of CUDA's, and nothing
// is allocated. Counters are atomic; allocate and free may be called from any thread.
#pragma once

#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace headroom {

class BudgetAllocator final : public c10::Allocator {
 public:
  // Installs the process-wide instance on first call (wrapping the current CPU allocator) and
  // returns it. Tensors allocated before installation are not counted, before or after.
  static BudgetAllocator& install();

  c10::DataPtr allocate(size_t bytes) override;
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t live_bytes() const { return live_.load(std::memory_order_relaxed); }
  int64_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  int64_t allocation_count() const { return allocations_.load(std::memory_order_relaxed); }
  // Peak restarts from the current live bytes.
  void reset_peak() { peak_.store(live_bytes(), std::memory_order_relaxed); }

  // nullopt: unlimited. A budget below the current live bytes only refuses new allocations.
  void set_budget(std::optional<int64_t> bytes);
  std::optional<int64_t> budget() const;

 private:
  explicit BudgetAllocator(c10::Allocator* inner) : inner_(inner) {}
  static void release(void* ptr);
  void on_free(void* ptr);

  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_deleter_ = nullptr;
  std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;  // live allocations
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> allocations_{0};
  std::atomic<int64_t> budget_{-1};
};

}  // namespace headroom
