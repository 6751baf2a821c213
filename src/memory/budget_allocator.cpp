#include "memory/budget_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <execinfo.h>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "util/size.h"

namespace headroom {
namespace {
BudgetAllocator* g_instance = nullptr;
std::once_flag g_install_once;
// Above the default CPU allocator's registration priority, so SetCPUAllocator takes it.
constexpr uint8_t kPriority = 200;

size_t size_class(int64_t bytes) {
  return std::min<size_t>(47, static_cast<size_t>(std::bit_width(static_cast<uint64_t>(bytes - 1))));
}
}  // namespace

BudgetAllocator& BudgetAllocator::install() {
  std::call_once(g_install_once, [] {
    // Leaked on purpose: tensors freed during static destruction still call release().
    g_instance = new BudgetAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(g_instance, kPriority);
    TORCH_CHECK(c10::GetCPUAllocator() == g_instance, "BudgetAllocator: SetCPUAllocator did not take effect");
  });
  return *g_instance;
}

BudgetAllocator* BudgetAllocator::installed() { return g_instance; }

void BudgetAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  host_peak_.store(host_live_bytes(), std::memory_order_relaxed);
  if (heap_ != nullptr) heap_->policy().reset_peaks();
  peak_.store(live_bytes(), std::memory_order_relaxed);
  peak_seq_.store(allocation_count(), std::memory_order_relaxed);
  peak_tagged_ = tagged_;
}

TaggedBytes BudgetAllocator::tagged_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tagged_;
}

TaggedBytes BudgetAllocator::peak_tagged_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_tagged_;
}

void BudgetAllocator::clear_last_oom() {
  std::lock_guard<std::mutex> lock(mutex_);
  last_oom_.reset();
}

void BudgetAllocator::set_budget(std::optional<int64_t> bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  budget_.store(bytes ? *bytes : -1);
  if (heap_ != nullptr) heap_->policy().set_limit(bytes);
}

std::optional<int64_t> BudgetAllocator::budget() const {
  const int64_t b = budget_.load();
  return b < 0 ? std::nullopt : std::optional<int64_t>(b);
}

void BudgetAllocator::set_context(int64_t step, Phase phase) {
  step_.store(step, std::memory_order_relaxed);
  phase_.store(static_cast<uint8_t>(phase), std::memory_order_relaxed);
}

void BudgetAllocator::fail_nth_allocation(int64_t n) {
  TORCH_CHECK(n >= 1, "fail_nth_allocation: n must be >= 1");
  fail_above_.store(-1);
  fail_countdown_.store(n);
}

void BudgetAllocator::fail_allocation_above(int64_t bytes) {
  fail_countdown_.store(0);
  fail_above_.store(bytes);
}

void BudgetAllocator::disarm() {
  fail_countdown_.store(0);
  fail_above_.store(-1);
}

void BudgetAllocator::refuse(int64_t bytes, int64_t live, int64_t cap, bool injected,
                             std::optional<CachingOom> caching) {
  OomEvent e;
  e.requested = bytes;
  e.live = live;
  e.budget = cap;
  e.step = step_.load();
  e.phase = static_cast<Phase>(phase_.load());
  e.sequence = allocation_count();
  e.tagged = tagged_bytes();
  e.injected = injected;
  e.caching = caching;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last_oom_ = e;
  }
  const std::string where = e.step >= 0 ? fmt::format(" during {} of step {}", phase_name(e.phase), e.step + 1) : "";
  if (injected) {
    C10_THROW_ERROR(OutOfMemoryError,
                    fmt::format("CPU out of memory (injected fault){}. Tried to allocate {}; {} in use.", where,
                                format_bytes(bytes), format_bytes(live)));
  }
  if (caching) {
    // In the words of CUDA's message, for the same situation.
    const std::string cause =
        caching->device_refused || caching->limit < 0
            ? "the machine's memory"
            : fmt::format("headroom budget {}", format_bytes(caching->limit));
    const std::string what = caching->expandable ? "pages to map"
                                                 : fmt::format("a new {} segment", format_bytes(caching->segment_bytes));
    const std::string advice =
        caching->expandable ? ""
                            : " If reserved but unallocated memory is large try --allocator-conf expandable_segments:True "
                              "(PYTORCH_CUDA_ALLOC_CONF on cuda) to avoid fragmentation.";
    C10_THROW_ERROR(OutOfMemoryError,
                    fmt::format("CPU out of memory ({}, caching allocator){}. Tried to allocate {} ({}). {} is "
                                "allocated by PyTorch, and {} is reserved by PyTorch but unallocated.{}",
                                cause, where, format_bytes(caching->rounded), what, format_bytes(caching->allocated),
                                format_bytes(std::max<int64_t>(0, caching->reserved - caching->allocated)), advice));
  }
  if (cap < 0) {
    C10_THROW_ERROR(OutOfMemoryError,
                    fmt::format("CPU out of memory (the machine's memory){}. Tried to allocate {}; {} in use by this "
                                "process's tensors.",
                                where, format_bytes(bytes), format_bytes(live)));
  }
  C10_THROW_ERROR(OutOfMemoryError,
                  fmt::format("CPU out of memory (headroom budget){}. Tried to allocate {}. Budget {}; {} in use; "
                              "{} free.",
                              where, format_bytes(bytes), format_bytes(cap), format_bytes(live),
                              format_bytes(std::max<int64_t>(0, cap - live))));
}

AllocationRecord BudgetAllocator::new_record(int64_t bytes) const {
  AllocationRecord rec;
  rec.bytes = bytes;
  rec.step = step_.load(std::memory_order_relaxed);
  rec.phase = static_cast<Phase>(phase_.load(std::memory_order_relaxed));
  rec.tag = tag();
  if (backtraces_.load(std::memory_order_relaxed)) rec.frames = ::backtrace(rec.stack.data(), kMaxFrames);
  if (const OriginSource source = origin_source_.load(std::memory_order_relaxed)) rec.origin = source();
  return rec;
}

void BudgetAllocator::record(void* ptr, AllocationRecord rec) {
  rec.sequence = count_.load(std::memory_order_relaxed) + 1;
  records_.emplace(ptr, rec);
  count_.store(rec.sequence, std::memory_order_relaxed);
  tagged_[rec.tag] += rec.bytes;
  ++histogram_[size_class(rec.bytes)];
  // Under the lock, so that the peak and the allocation that set it agree.
  const int64_t now = live_bytes();
  if (now > peak_.load(std::memory_order_relaxed)) {
    peak_.store(now, std::memory_order_relaxed);
    peak_seq_.store(rec.sequence, std::memory_order_relaxed);
    peak_tagged_ = tagged_;
  }
}

c10::DataPtr BudgetAllocator::allocate(size_t bytes) {
  if (!accounting_.load(std::memory_order_relaxed)) return inner_->allocate(bytes);
  if (pool() == MemoryPool::host) return allocate_host(bytes);
  const auto n = static_cast<int64_t>(bytes);
  if (fail_countdown_.load(std::memory_order_relaxed) > 0 && fail_countdown_.fetch_sub(1) == 1) {
    refuse(n, live_bytes(), budget_.load(), /*injected=*/true);
  }
  int64_t above = fail_above_.load(std::memory_order_relaxed);
  if (above >= 0 && n > above && fail_above_.compare_exchange_strong(above, -1)) {
    refuse(n, live_bytes(), budget_.load(), /*injected=*/true);
  }
  if (caching_.load(std::memory_order_relaxed) && n > 0) {
    if (auto cached = allocate_cached(n)) return std::move(*cached);  // else switched back to counting meanwhile
  }
  // Reserve the bytes before allocating, so that concurrent allocations cannot together pass the
  // budget; give them back if the allocation does not happen.
  const int64_t cap = budget_.load(std::memory_order_relaxed);
  int64_t live = live_.load(std::memory_order_relaxed);
  do {
    if (cap >= 0 && live + n > cap) refuse(n, live, cap, /*injected=*/false);
  } while (!live_.compare_exchange_weak(live, live + n, std::memory_order_relaxed));
  c10::DataPtr inner;
  try {
    inner = inner_->allocate(bytes);
  } catch (const c10::OutOfMemoryError&) {
    live_.fetch_sub(n, std::memory_order_relaxed);
    throw;
  } catch (const c10::Error&) {
    // The machine itself is out of memory (ATen's CPU allocator raises a plain enforce failure):
    // the same out-of-memory as a budget's, so that the guard and the diagnosis see it.
    live_.fetch_sub(n, std::memory_order_relaxed);
    refuse(n, live, -1, /*injected=*/false);
  } catch (...) {
    live_.fetch_sub(n, std::memory_order_relaxed);
    throw;
  }
  void* ptr = inner.get();
  if (ptr == nullptr) {  // zero-byte allocations carry no memory
    live_.fetch_sub(n, std::memory_order_relaxed);
    return inner;
  }
  AllocationRecord rec = new_record(n);
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(inner.get_context() == ptr, "BudgetAllocator: the wrapped CPU allocator uses contexts");
    if (inner_deleter_ == nullptr) inner_deleter_ = inner.get_deleter();
    TORCH_CHECK(inner.get_deleter() == inner_deleter_, "BudgetAllocator: the wrapped allocator's deleter varies");
    record(ptr, rec);
  } catch (...) {
    live_.fetch_sub(n, std::memory_order_relaxed);
    throw;  // `inner` still owns the memory and frees it
  }
  inner.release_context();
  return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
}

c10::DataPtr BudgetAllocator::allocate_host(size_t bytes) {
  c10::DataPtr inner = inner_->allocate(bytes);
  void* ptr = inner.get();
  if (ptr == nullptr) return inner;
  const auto n = static_cast<int64_t>(bytes);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(inner.get_context() == ptr, "BudgetAllocator: the wrapped CPU allocator uses contexts");
    if (inner_deleter_ == nullptr) inner_deleter_ = inner.get_deleter();
    TORCH_CHECK(inner.get_deleter() == inner_deleter_, "BudgetAllocator: the wrapped allocator's deleter varies");
    host_records_.emplace(ptr, n);
    const int64_t now = host_live_.fetch_add(n, std::memory_order_relaxed) + n;
    if (now > host_peak_.load(std::memory_order_relaxed)) host_peak_.store(now, std::memory_order_relaxed);
  }
  inner.release_context();
  return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
}

std::optional<c10::DataPtr> BudgetAllocator::allocate_cached(int64_t n) {
  AllocationRecord rec = new_record(n);
  std::optional<CachingOom> refused;
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (heap_ == nullptr) return std::nullopt;
    ptr = heap_->allocate(n);
    if (ptr == nullptr) {
      refused = heap_->policy().last_oom();
    } else {
      rec.heap = heap_.get();
      live_.fetch_add(n, std::memory_order_relaxed);
      record(ptr, rec);
    }
  }
  if (ptr == nullptr) refuse(n, live_bytes(), budget_.load(), /*injected=*/false, refused);
  return c10::DataPtr(ptr, ptr, &release, c10::Device(c10::DeviceType::CPU));
}

void BudgetAllocator::release(void* ptr) {
  if (ptr != nullptr) g_instance->on_free(ptr);  // raw_deallocate of a zero-byte raw_allocate
}

void BudgetAllocator::on_free(void* ptr) {
  c10::DeleterFnPtr deleter = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = records_.find(ptr);
    if (it == records_.end()) {
      auto host = host_records_.find(ptr);
      if (host == host_records_.end()) {
        // Called from a deleter, which must not throw: a broken invariant ends the process plainly.
        std::fprintf(stderr, "headroom: internal error: BudgetAllocator freeing %p, which it did not allocate\n", ptr);
        std::abort();
      }
      host_live_.fetch_sub(host->second, std::memory_order_relaxed);
      host_records_.erase(host);
    } else {
      const int64_t bytes = it->second.bytes;
      CachingHeap* heap = it->second.heap;
      tagged_[it->second.tag] -= bytes;
      records_.erase(it);
      live_.fetch_sub(bytes, std::memory_order_relaxed);
      if (heap != nullptr) {
        heap->free(ptr);
        if (heap != heap_.get() && heap->empty()) {
          std::erase_if(retired_, [&](const auto& h) { return h.get() == heap; });  // its last block: unmapped
        }
        return;
      }
    }
    deleter = inner_deleter_;
  }
  deleter(ptr);
}

void BudgetAllocator::use_caching(std::optional<AllocatorConfig> config) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (heap_ != nullptr) {
    heap_->policy().set_observer(nullptr);
    heap_->policy().empty_cache();
    if (!heap_->empty()) retired_.push_back(std::move(heap_));
    heap_.reset();
  }
  caching_.store(config.has_value());
  if (!config) return;
  const int64_t cap = budget_.load();
  heap_ = std::make_unique<CachingHeap>(*config, cap < 0 ? std::nullopt : std::optional<int64_t>(cap));
  if (history_max_ > 0) heap_->policy().set_observer([this](const TraceEvent& e) { observe(e); });
}

std::optional<CachingStats> BudgetAllocator::caching_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (heap_ == nullptr) return std::nullopt;
  return heap_->policy().stats();
}

std::vector<SegmentInfo> BudgetAllocator::caching_segments() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (heap_ == nullptr) return {};
  return heap_->policy().segments();
}

std::optional<AllocatorConfig> BudgetAllocator::caching_config() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (heap_ == nullptr) return std::nullopt;
  return heap_->policy().config();
}

void BudgetAllocator::set_caching_config(const AllocatorConfig& config) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(heap_ != nullptr, "BudgetAllocator::set_caching_config: not caching");
  heap_->policy().set_config(config);
}

void BudgetAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (heap_ != nullptr) heap_->policy().empty_cache();
}

void BudgetAllocator::record_history(size_t max_entries) {
  std::lock_guard<std::mutex> lock(mutex_);
  history_max_ = max_entries;
  history_.clear();
  history_next_ = 0;
  history_start_us_ = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  if (heap_ == nullptr) return;
  if (max_entries > 0) {
    heap_->policy().set_observer([this](const TraceEvent& e) { observe(e); });
  } else {
    heap_->policy().set_observer(nullptr);
  }
}

void BudgetAllocator::observe(const TraceEvent& e) {
  HistoryEntry h;
  h.event = e;
  h.time_us = std::chrono::duration_cast<std::chrono::microseconds>(
                  std::chrono::steady_clock::now().time_since_epoch())
                  .count() -
              history_start_us_;
  h.step = step_.load(std::memory_order_relaxed);
  h.phase = static_cast<Phase>(phase_.load(std::memory_order_relaxed));
  if (history_.size() < history_max_) {
    history_.push_back(h);
  } else {
    history_[history_next_] = h;
    history_next_ = (history_next_ + 1) % history_max_;
  }
}

std::vector<HistoryEntry> BudgetAllocator::history() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<HistoryEntry> out(history_.begin() + static_cast<std::ptrdiff_t>(history_next_), history_.end());
  out.insert(out.end(), history_.begin(), history_.begin() + static_cast<std::ptrdiff_t>(history_next_));
  return out;
}

std::optional<AllocationRecord> BudgetAllocator::record_of(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = records_.find(ptr);
  if (it == records_.end()) return std::nullopt;
  return it->second;
}

std::vector<LiveAllocation> BudgetAllocator::live_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<LiveAllocation> out;
  out.reserve(records_.size());
  for (const auto& [ptr, rec] : records_) out.push_back({ptr, rec});
  return out;
}

std::optional<OomEvent> BudgetAllocator::last_oom() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_oom_;
}

std::array<int64_t, 48> BudgetAllocator::size_histogram() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return histogram_;
}

}  // namespace headroom
