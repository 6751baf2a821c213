#include "memory/memory_probe.h"

#include "device/cuda_adapter.h"
#include "memory/budget_allocator.h"

namespace headroom {
namespace {

class CpuProbe final : public MemoryProbe {
 public:
  CpuProbe() : allocator_(BudgetAllocator::install()) {}
  int64_t live_bytes() const override { return allocator_.live_bytes(); }
  int64_t peak_bytes() const override { return allocator_.peak_bytes(); }
  void reset_peak() override { allocator_.reset_peak(); }

 private:
  BudgetAllocator& allocator_;
};

class CudaProbe final : public MemoryProbe {
 public:
  explicit CudaProbe(int index) : index_(index) {}
  int64_t live_bytes() const override { return cuda_memory_stats(index_).allocated_bytes; }
  int64_t peak_bytes() const override { return cuda_memory_stats(index_).peak_allocated_bytes; }
  void reset_peak() override { cuda_reset_peak_stats(index_); }

 private:
  int index_;
};

}  // namespace

std::unique_ptr<MemoryProbe> make_memory_probe(const c10::Device& device) {
  if (device.is_cuda()) return std::make_unique<CudaProbe>(device.has_index() ? device.index() : 0);
  return std::make_unique<CpuProbe>();
}

}  // namespace headroom
