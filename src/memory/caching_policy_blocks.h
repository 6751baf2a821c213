// The blocks and pools behind CachingPolicy (memory/caching_policy.h), shared by its files:
// caching_policy.cpp (construction, the rules, stats, what it holds), caching_policy_allocate.cpp
// (a request served from the cache: best fit, split; a free: merge), caching_policy_segments.cpp
// (segments taken from the source and released to it, the garbage collector) and
// caching_policy_expandable.cpp (expandable segments: address space, pages mapped and unmapped).
// A Block is a range of a segment, allocated or free, linked to its neighbours in that segment; a
// free mapped block sits in its pool's `blocks`, ordered for the best fit (stream, then size, then
// address), an unmapped range of an expandable segment in `unmapped` (stream, then address). The
// policy owns every block: the live ones through allocated_, the free ones through its pools.
// Private to the policy.
#pragma once

#include <cstdint>
#include <set>

#include "memory/caching_policy.h"

namespace headroom {

struct CachingPolicy::Block {
  uint64_t address = 0;
  int64_t size = 0;
  int64_t requested = 0;
  int stream = 0;
  Pool* pool = nullptr;
  bool allocated = false;
  bool mapped = true;
  Block* prev = nullptr;  // neighbours in the same segment
  Block* next = nullptr;
  Expandable* expandable = nullptr;
  int64_t gc_base = 0;  // the pool's search count when the block became free

  bool is_split() const { return prev != nullptr || next != nullptr; }
  void splice(Block* before, Block* after) {
    if (before != nullptr) before->next = this;
    prev = before;
    if (after != nullptr) after->prev = this;
    next = after;
  }
};

struct CachingPolicy::Pool {
  // Best fit: stream, then size, then address (a search key has address 0).
  struct BySize {
    bool operator()(const Block* a, const Block* b) const {
      if (a->stream != b->stream) return a->stream < b->stream;
      if (a->size != b->size) return a->size < b->size;
      return a->address < b->address;
    }
  };
  struct ByAddress {
    bool operator()(const Block* a, const Block* b) const {
      if (a->stream != b->stream) return a->stream < b->stream;
      return a->address < b->address;
    }
  };

  bool small = false;
  std::set<Block*, BySize> blocks;       // free, mapped
  std::set<Block*, ByAddress> unmapped;  // expandable address space without pages
  int64_t searches = 0;                  // get_free_block calls, the garbage collector's clock

  void insert(Block* b) {
    b->gc_base = searches;
    blocks.insert(b);
  }
};

struct CachingPolicy::Expandable {
  uint64_t base = 0;
  int64_t size = 0;  // address space
  int64_t page = 0;
};

struct CachingPolicy::Request {
  int64_t requested = 0;
  int64_t size = 0;  // rounded
  int stream = 0;
  Pool* pool = nullptr;
  int64_t alloc_size = 0;  // a new segment's size
  Block* block = nullptr;
  bool device_refused = false;
};

// v rounded up to a multiple of m.
inline int64_t round_up_to(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace headroom
