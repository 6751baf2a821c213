// CachingHeap — host memory served the way PyTorch's CUDA caching allocator serves device memory:
// the cpu caching allocator's memory (--allocator caching).
//
// The decisions are CachingPolicy's; this file is the driver's part on the CPU. A segment is an
// anonymous mmap; an expandable segment is address space reserved with PROT_NONE whose 2 MiB or
// 20 MiB pages are made accessible when mapped and handed back (MADV_DONTNEED) when unmapped, so
// reserved bytes are the host memory the process really holds for it. Blocks keep the alignment of
// their 512-byte multiples inside page-aligned segments.
//
// Not thread-safe: the BudgetAllocator serialises calls. Destroying a heap unmaps all its memory; the
// caller keeps it alive while any block is.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <unordered_map>

#include "memory/caching_policy.h"

namespace headroom {

class CachingHeap {
 public:
  CachingHeap(const AllocatorConfig& config, std::optional<int64_t> limit);
  ~CachingHeap();
  CachingHeap(const CachingHeap&) = delete;
  CachingHeap& operator=(const CachingHeap&) = delete;

  // Host memory for `bytes` (> 0), or null when out of memory (policy().last_oom() says why).
  void* allocate(int64_t bytes);
  void free(void* ptr);
  bool empty() const { return addresses_.empty(); }

  CachingPolicy& policy() { return policy_; }
  const CachingPolicy& policy() const { return policy_; }

 private:
  class HostSegments final : public SegmentSource {
   public:
    ~HostSegments() override;
    bool allocate(uint64_t address, int64_t bytes) override;
    void free(uint64_t address, int64_t bytes) override;
    bool reserve(uint64_t address, int64_t bytes) override;
    void unreserve(uint64_t address, int64_t bytes) override;
    bool map(uint64_t address, int64_t bytes) override;
    void unmap(uint64_t address, int64_t bytes) override;
    void* host(uint64_t address) const;

   private:
    struct Region {
      void* base = nullptr;
      int64_t bytes = 0;
    };
    std::map<uint64_t, Region> regions_;  // by policy address
  };

  HostSegments segments_;
  CachingPolicy policy_;
  std::unordered_map<void*, uint64_t> addresses_;  // live blocks: host pointer -> policy address
};

}  // namespace headroom
