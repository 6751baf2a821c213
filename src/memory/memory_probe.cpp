#include "memory/memory_probe.h"

#include "device/cuda_adapter.h"
#include "util/error.h"
#include "util/size.h"

namespace headroom {
namespace {

class CpuProbe final : public MemoryProbe {
 public:
  CpuProbe() : a_(BudgetAllocator::install()) {}
  int64_t live_bytes() const override { return a_.live_bytes(); }
  int64_t peak_bytes() const override { return a_.peak_bytes(); }
  void reset_peak() override { a_.reset_peak(); }
  void set_context(int64_t step, Phase phase) override { a_.set_context(step, phase); }
  std::optional<uint64_t> peak_sequence() const override { return a_.peak_sequence(); }
  std::optional<uint64_t> sequence_of(const void* ptr) const override {
    auto r = a_.record_of(ptr);
    return r ? std::optional<uint64_t>(r->sequence) : std::nullopt;
  }
  std::vector<LiveAllocation> live_allocations() const override { return a_.live_allocations(); }
  std::optional<OomEvent> last_oom() const override { return a_.last_oom(); }
  void clear_last_oom() override { a_.clear_last_oom(); }
  void set_budget(std::optional<int64_t> bytes) override { a_.set_budget(bytes); }
  std::optional<int64_t> budget() const override { return a_.budget(); }
  std::string source() const override { return "cpu (headroom counting allocator)"; }

 private:
  BudgetAllocator& a_;
};

class CudaProbe final : public MemoryProbe {
 public:
  explicit CudaProbe(int index) : index_(index) { cuda_init(); }
  int64_t live_bytes() const override { return cuda_memory_stats(index_).allocated_bytes; }
  int64_t peak_bytes() const override { return cuda_memory_stats(index_).peak_allocated_bytes; }
  void reset_peak() override { cuda_reset_peak_stats(index_); }
  void set_context(int64_t step, Phase phase) override { cuda_set_allocation_origin(step, static_cast<int>(phase)); }
  void record_origins(bool enabled) override { cuda_record_allocation_origins(enabled); }
  std::vector<LiveAllocation> live_allocations() const override {
    std::vector<LiveAllocation> out;
    for (const CudaLiveBlock& b : cuda_live_blocks(index_)) {
      LiveAllocation a;
      a.record.bytes = b.requested_bytes;
      a.record.step = b.step;
      a.record.phase = static_cast<Phase>(b.phase);
      out.push_back(a);
    }
    return out;
  }
  void set_budget(std::optional<int64_t> bytes) override {
    const int64_t total = cuda_device_memory(index_).total_bytes;
    if (bytes && *bytes > total) {
      fail("--memory-budget {} is larger than cuda:{}'s {}", format_bytes(*bytes), index_, format_bytes(total));
    }
    budget_ = bytes;
    cuda_set_memory_fraction(index_, bytes ? static_cast<double>(*bytes) / static_cast<double>(total) : 1.0);
  }
  std::optional<int64_t> budget() const override { return budget_; }
  std::string source() const override { return fmt::format("cuda:{} (caching allocator, allocated bytes)", index_); }

 private:
  int index_;
  std::optional<int64_t> budget_;
};

}  // namespace

std::unique_ptr<MemoryProbe> make_memory_probe(const c10::Device& device) {
  if (device.is_cuda()) return std::make_unique<CudaProbe>(device.has_index() ? device.index() : 0);
  return std::make_unique<CpuProbe>();
}

}  // namespace headroom
