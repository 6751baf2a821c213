#include "memory/caching_heap.h"

#include <c10/util/Exception.h>
#include <sys/mman.h>

namespace headroom {

CachingHeap::HostSegments::~HostSegments() {
  for (const auto& [address, r] : regions_) ::munmap(r.base, static_cast<size_t>(r.bytes));
}

bool CachingHeap::HostSegments::allocate(uint64_t address, int64_t bytes) {
  void* p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  regions_[address] = {p, bytes};
  return true;
}

void CachingHeap::HostSegments::free(uint64_t address, int64_t bytes) {
  auto it = regions_.find(address);
  TORCH_CHECK(it != regions_.end() && it->second.bytes == bytes, "CachingHeap: freeing a segment it does not hold");
  ::munmap(it->second.base, static_cast<size_t>(bytes));
  regions_.erase(it);
}

bool CachingHeap::HostSegments::reserve(uint64_t address, int64_t bytes) {
  void* p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return false;
  regions_[address] = {p, bytes};
  return true;
}

void CachingHeap::HostSegments::unreserve(uint64_t address, int64_t bytes) { free(address, bytes); }

bool CachingHeap::HostSegments::map(uint64_t address, int64_t bytes) {
  return ::mprotect(host(address), static_cast<size_t>(bytes), PROT_READ | PROT_WRITE) == 0;
}

void CachingHeap::HostSegments::unmap(uint64_t address, int64_t bytes) {
  void* p = host(address);
  // The pages go back to the system now; touching them again would be a bug, so they are sealed.
  ::madvise(p, static_cast<size_t>(bytes), MADV_DONTNEED);
  ::mprotect(p, static_cast<size_t>(bytes), PROT_NONE);
}

void* CachingHeap::HostSegments::host(uint64_t address) const {
  auto it = regions_.upper_bound(address);
  TORCH_CHECK(it != regions_.begin(), "CachingHeap: address ", address, " is in no segment");
  --it;
  TORCH_CHECK(address < it->first + static_cast<uint64_t>(it->second.bytes), "CachingHeap: address ", address,
              " is in no segment");
  return static_cast<char*>(it->second.base) + (address - it->first);
}

CachingHeap::CachingHeap(const AllocatorConfig& config, std::optional<int64_t> limit)
    : policy_(config, limit, &segments_) {}

CachingHeap::~CachingHeap() = default;

void* CachingHeap::allocate(int64_t bytes) {
  const std::optional<uint64_t> address = policy_.allocate(bytes);
  if (!address) return nullptr;
  void* p = segments_.host(*address);
  addresses_.emplace(p, *address);
  return p;
}

void CachingHeap::free(void* ptr) {
  auto it = addresses_.find(ptr);
  TORCH_CHECK(it != addresses_.end(), "CachingHeap: freeing memory it did not allocate");
  policy_.free(it->second);
  addresses_.erase(it);
}

}  // namespace headroom
