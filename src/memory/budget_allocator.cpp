#include "memory/budget_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "util/size.h"

namespace headroom {
namespace {
BudgetAllocator* g_instance = nullptr;
std::once_flag g_install_once;
// Above the default CPU allocator's registration priority, so SetCPUAllocator takes it.
constexpr uint8_t kPriority = 200;
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

void BudgetAllocator::set_budget(std::optional<int64_t> bytes) { budget_.store(bytes ? *bytes : -1); }

std::optional<int64_t> BudgetAllocator::budget() const {
  const int64_t b = budget_.load();
  return b < 0 ? std::nullopt : std::optional<int64_t>(b);
}

c10::DataPtr BudgetAllocator::allocate(size_t bytes) {
  const auto n = static_cast<int64_t>(bytes);
  const int64_t cap = budget_.load(std::memory_order_relaxed);
  if (cap >= 0 && live_bytes() + n > cap) {
    const int64_t live = live_bytes();
    C10_THROW_ERROR(OutOfMemoryError,
                    fmt::format("CPU out of memory (headroom budget). Tried to allocate {}. Budget {}; {} "
                                "in use; {} free.",
                                format_bytes(n), format_bytes(cap), format_bytes(live),
                                format_bytes(std::max<int64_t>(0, cap - live))));
  }
  c10::DataPtr inner = inner_->allocate(bytes);
  void* ptr = inner.get();
  if (ptr == nullptr) return inner;  // zero-byte allocations carry no memory
  TORCH_CHECK(inner.get_context() == ptr, "BudgetAllocator: the wrapped CPU allocator uses contexts");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (inner_deleter_ == nullptr) inner_deleter_ = inner.get_deleter();
    TORCH_CHECK(inner.get_deleter() == inner_deleter_, "BudgetAllocator: the wrapped allocator's deleter varies");
    sizes_.emplace(ptr, bytes);
  }
  inner.release_context();
  const int64_t live = live_.fetch_add(n, std::memory_order_relaxed) + n;
  int64_t peak = peak_.load(std::memory_order_relaxed);
  while (live > peak && !peak_.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
  }
  allocations_.fetch_add(1, std::memory_order_relaxed);
  return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
}

void BudgetAllocator::release(void* ptr) { g_instance->on_free(ptr); }

void BudgetAllocator::on_free(void* ptr) {
  size_t bytes = 0;
  c10::DeleterFnPtr deleter = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sizes_.find(ptr);
    TORCH_CHECK(it != sizes_.end(), "BudgetAllocator: freeing a pointer it did not allocate");
    bytes = it->second;
    sizes_.erase(it);
    deleter = inner_deleter_;
  }
  live_.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  deleter(ptr);
}

}  // namespace headroom
