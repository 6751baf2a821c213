// MemoryProbe — live and peak bytes of the device a run trains on, behind one interface.
//
// cpu: the BudgetAllocator's exact counts (installed by make_memory_probe). cuda: the caching
// allocator's allocated bytes (device/cuda_adapter.h). Peaks are since the last reset_peak().
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

namespace headroom {

class MemoryProbe {
 public:
  virtual ~MemoryProbe() = default;
  virtual int64_t live_bytes() const = 0;
  virtual int64_t peak_bytes() const = 0;
  virtual void reset_peak() = 0;
};

std::unique_ptr<MemoryProbe> make_memory_probe(const c10::Device& device);

}  // namespace headroom
