// HostPoolScope — while one is alive, this process's cpu tensor allocations are host memory: the
// budget allocator (memory/budget_allocator.h) counts them in its host pool, apart from the
// simulated device, and never against its budget. Where the allocator is not installed (cuda runs)
// it does nothing. Scopes nest; each restores the pool it found.
#pragma once

#include "memory/budget_allocator.h"

namespace headroom {

class HostPoolScope {
 public:
  HostPoolScope() : allocator_(BudgetAllocator::installed()) {
    if (allocator_ != nullptr) {
      previous_ = allocator_->pool();
      allocator_->set_pool(MemoryPool::host);
    }
  }
  ~HostPoolScope() {
    if (allocator_ != nullptr) allocator_->set_pool(previous_);
  }
  HostPoolScope(const HostPoolScope&) = delete;
  HostPoolScope& operator=(const HostPoolScope&) = delete;

 private:
  BudgetAllocator* allocator_;
  MemoryPool previous_ = MemoryPool::device;
};

}  // namespace headroom
