// Cache policy (after_oom, empty_cache_after_reshape) — when the CUDA caching allocator's own
// levers help (lever 2's cousin: memory that is reserved but not usable), decided from its
// measured statistics, never on every step.
//
// PyTorch's allocator already frees unused cached segments and retries before it raises an OOM, so
// after one, what can still stand between the request and the memory is fragmentation: free bytes
// split inside segments that hold live blocks (inactive split). When those could have held the
// request, or when the live bytes and the request together fit the cap (so only segments stand in
// the way), expandable segments (one growing mapping per stream instead of fixed segments, whose
// free pages go back) are the fix, and the same micro-batch is worth one more try. When the guard shrinks the micro-batch, the
// cached segments were cut for the old shapes: returning them (empty_cache) once lets the new
// shapes start from clean segments. Otherwise nothing is done and the guard halves the micro-batch.
#pragma once

#include <cstdint>
#include <string>

namespace headroom {

struct CacheState {
  int64_t allocated = 0;             // live bytes when the OOM was raised
  int64_t reserved = 0;              // held by the allocator
  int64_t inactive_split = 0;        // free bytes inside segments with live blocks
  int64_t requested = 0;             // the allocation that failed (0: unknown)
  bool expandable_segments = false;  // already on
  int64_t limit = -1;                // the cap on reserved bytes (a budget or memory fraction); -1: none
};

enum class CacheAction { none, expandable_segments };

struct CacheDecision {
  CacheAction action = CacheAction::none;
  std::string reason;
};

// After an OOM on cuda: whether to switch allocator settings and retry the same micro-batch.
CacheDecision after_oom(const CacheState& s);

// After the guard changed the micro-batch: whether the cached segments are worth returning (the
// reserved-but-unallocated gap is at least `fraction` of what is reserved).
bool empty_cache_after_reshape(int64_t allocated, int64_t reserved, double fraction = 0.2);

}  // namespace headroom
