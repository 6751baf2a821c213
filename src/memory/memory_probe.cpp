#include "memory/memory_probe.h"

#include "device/cuda_adapter.h"
#include "device/pickle_adapter.h"
#include "memory/allocator_config.h"
#include "memory/allocator_snapshot.h"
#include "util/error.h"
#include "util/size.h"

namespace headroom {
namespace {

AllocatorState state_of(const CachingStats& s, bool expandable) {
  AllocatorState a;
  a.allocated = s.allocated_bytes.current;
  a.peak_allocated = s.allocated_bytes.peak;
  a.reserved = s.reserved_bytes.current;
  a.peak_reserved = s.reserved_bytes.peak;
  a.inactive_split = s.inactive_split_bytes.current;
  a.peak_inactive_split = s.inactive_split_bytes.peak;
  a.alloc_retries = s.num_alloc_retries;
  a.ooms = s.num_ooms;
  a.expandable_segments = expandable;
  return a;
}

class CpuProbe final : public MemoryProbe {
 public:
  CpuProbe(bool caching, const std::string& settings) : a_(BudgetAllocator::install()) {
    a_.use_caching(caching ? std::optional<AllocatorConfig>(parse_allocator_config(settings, "--allocator-conf"))
                           : std::nullopt);
  }
  ~CpuProbe() override {
    if (a_.caching()) a_.use_caching(std::nullopt);  // returns its cache; live blocks stay valid
  }
  std::optional<AllocatorState> allocator_state() const override {
    const auto stats = a_.caching_stats();
    if (!stats) return std::nullopt;
    return state_of(*stats, a_.caching_config()->expandable_segments);
  }
  void empty_cache() override { a_.empty_cache(); }
  std::string snapshot_pickle() const override {
    TORCH_CHECK(a_.caching(), "a memory snapshot needs the caching allocator");
    return pickle_value(allocator_snapshot(a_.caching_segments(), a_.history(), *a_.caching_config()));
  }
  void enable_expandable_segments() override {
    if (!a_.caching()) return;
    AllocatorConfig c = *a_.caching_config();
    c.expandable_segments = true;
    a_.set_caching_config(c);
  }
  int64_t live_bytes() const override { return a_.live_bytes(); }
  int64_t peak_bytes() const override { return a_.peak_bytes(); }
  void reset_peak() override { a_.reset_peak(); }
  std::optional<int64_t> host_peak_bytes() const override { return a_.host_peak_bytes(); }
  void set_context(int64_t step, Phase phase) override { a_.set_context(step, phase); }
  std::optional<uint64_t> peak_sequence() const override { return a_.peak_sequence(); }
  void set_tag(AllocationTag tag) override { a_.set_tag(tag); }
  TaggedBytes tagged_bytes() const override { return a_.tagged_bytes(); }
  TaggedBytes peak_tagged_bytes() const override { return a_.peak_tagged_bytes(); }
  std::optional<uint64_t> sequence_of(const void* ptr) const override {
    auto r = a_.record_of(ptr);
    return r ? std::optional<uint64_t>(r->sequence) : std::nullopt;
  }
  std::vector<LiveAllocation> live_allocations() const override { return a_.live_allocations(); }
  std::optional<OomEvent> last_oom() const override { return a_.last_oom(); }
  void clear_last_oom() override { a_.clear_last_oom(); }
  void set_budget(std::optional<int64_t> bytes) override { a_.set_budget(bytes); }
  std::optional<int64_t> budget() const override { return a_.budget(); }
  std::string source() const override {
    return a_.caching() ? "cpu (headroom caching allocator, PyTorch's CUDA policy)" : "cpu (headroom counting allocator)";
  }

 private:
  BudgetAllocator& a_;
};

class CudaProbe final : public MemoryProbe {
 public:
  CudaProbe(int index, const std::string& settings) : index_(index) {
    cuda_init();
    if (!settings.empty()) {
      expandable_ = parse_allocator_config(settings, "--allocator-conf").expandable_segments;  // one-line errors first
      cuda_set_allocator_settings(settings);
    }
  }
  std::optional<AllocatorState> allocator_state() const override {
    const CudaMemoryStats st = cuda_memory_stats(index_);
    AllocatorState a;
    a.allocated = st.allocated_bytes;
    a.peak_allocated = st.peak_allocated_bytes;
    a.reserved = st.reserved_bytes;
    a.peak_reserved = st.peak_reserved_bytes;
    a.inactive_split = st.inactive_split_bytes;
    a.peak_inactive_split = st.peak_inactive_split_bytes;
    a.alloc_retries = st.alloc_retries;
    a.ooms = st.ooms;
    a.expandable_segments = expandable_;
    return a;
  }
  void empty_cache() override { cuda_empty_cache(); }
  std::string snapshot_pickle() const override { return cuda_memory_snapshot_pickle(); }
  void enable_expandable_segments() override {
    cuda_set_allocator_settings("expandable_segments:True");
    expandable_ = true;
  }
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
  bool expandable_ = false;
};

}  // namespace

std::string MemoryProbe::snapshot_pickle() const { TORCH_CHECK(false, "this allocator keeps no memory snapshot"); }

std::unique_ptr<MemoryProbe> make_memory_probe(const c10::Device& device, bool caching,
                                               const std::string& settings) {
  if (device.is_cuda()) return std::make_unique<CudaProbe>(device.has_index() ? device.index() : 0, settings);
  return std::make_unique<CpuProbe>(caching, settings);
}

}  // namespace headroom
