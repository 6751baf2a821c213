// CachingPolicy (memory/caching_policy.h): segments taken from the source under the cap, and
// cached ones released to it (oversize blocks first, then every unsplit one; empty_cache; the
// garbage collector's oldest blocks).
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "memory/caching_policy.h"
#include "memory/caching_policy_blocks.h"

namespace headroom {

bool CachingPolicy::alloc_block(Request& r, bool retry) {
  if (retry) ++stats_.num_alloc_retries;
  const int64_t size = r.alloc_size;
  if (limit_ && total_reserved_ + size > *limit_) return false;
  if (config_.expandable_segments) {
    r.block = try_allocate_expandable(r);
    return r.block != nullptr;
  }
  const uint64_t address = take_address(size);
  if (!source_->allocate(address, size)) {
    r.device_refused = true;
    return false;
  }
  total_reserved_ += size;
  auto* b = new Block;
  b->address = address;
  b->size = size;
  b->stream = r.stream;
  b->pool = r.pool;
  r.block = b;
  stats_.segment.add(1);
  stats_.reserved_bytes.add(size);
  ++stats_.num_device_alloc;
  emit(TraceAction::segment_alloc, address, size, r.stream);
  return true;
}

void CachingPolicy::release_block(Block* b) {
  TORCH_CHECK(b->expandable == nullptr && !b->is_split() && !b->allocated,
              "CachingPolicy: only a whole free segment can be released");
  source_->free(b->address, b->size);
  total_reserved_ -= b->size;
  b->pool->blocks.erase(b);
  stats_.segment.sub(1);
  stats_.reserved_bytes.sub(b->size);
  ++stats_.num_device_free;
  emit(TraceAction::segment_free, b->address, b->size, b->stream);
  delete b;
}

bool CachingPolicy::release_available_cached_blocks(Request& r) {
  if (config_.max_split_size == std::numeric_limits<int64_t>::max()) return false;
  Pool& pool = *r.pool;
  Block key;
  key.stream = r.stream;
  key.size = std::max(r.size, config_.max_split_size);
  auto it = pool.blocks.lower_bound(&key);
  if (it == pool.blocks.end() || (*it)->stream != r.stream || (*it)->expandable != nullptr) {
    // No single oversize block is large enough: free oversize blocks, largest first.
    if (it == pool.blocks.begin()) return false;
    int64_t released = 0;
    --it;
    while (released < key.size && (*it)->size >= config_.max_split_size && (*it)->stream == r.stream) {
      auto cur = it;
      const bool first = cur == pool.blocks.begin();
      if (!first) --it;
      if ((*cur)->expandable == nullptr) {
        released += (*cur)->size;
        release_block(*cur);
      }
      if (first) break;
    }
    return released >= key.size;
  }
  release_block(*it);
  return true;
}

void CachingPolicy::release_blocks(Pool& pool) {
  std::vector<Block*> to_unmap;
  for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
    Block* b = *it;
    ++it;
    if (b->expandable != nullptr) {
      to_unmap.push_back(b);
    } else if (!b->is_split()) {
      release_block(b);
    }
  }
  for (Block* b : to_unmap) {
    unmap_block(b);
    // A whole expandable segment unmapped: its address space goes too.
    if (!b->is_split() && !b->mapped) {
      source_->unreserve(b->address, b->size);
      pool.unmapped.erase(b);
      std::erase_if(expandable_, [&](const auto& e) { return e.get() == b->expandable; });
      delete b;
    }
  }
}

bool CachingPolicy::release_cached_blocks() {
  release_blocks(*large_);
  release_blocks(*small_);
  return true;
}

void CachingPolicy::empty_cache() { release_cached_blocks(); }

void CachingPolicy::garbage_collect() {
  const auto threshold = static_cast<int64_t>(config_.garbage_collection_threshold * static_cast<double>(*limit_));
  if (total_reserved_ <= threshold) return;
  const int64_t target = total_reserved_ - threshold;
  Pool& pool = *large_;
  auto age = [&](const Block* b) { return pool.searches - b->gc_base; };
  int64_t total_age = 0, freeable = 0;
  for (const Block* b : pool.blocks) {
    if (!b->is_split()) {
      total_age += age(b);
      ++freeable;
    }
  }
  if (freeable == 0) return;
  int64_t reclaimed = 0;
  bool freed = true;
  // Blocks at least as old as the average go first, round after round, until enough is back.
  while (reclaimed < target && freed && freeable > 0) {
    const double threshold_age = static_cast<double>(total_age) / static_cast<double>(freeable);
    freed = false;
    for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
      Block* b = *it;
      ++it;
      if (!b->is_split() && b->expandable == nullptr && static_cast<double>(age(b)) >= threshold_age) {
        freed = true;
        reclaimed += b->size;
        total_age -= age(b);
        --freeable;
        release_block(b);
      }
    }
  }
}

}  // namespace headroom
