// CachingPolicy (memory/caching_policy.h) with expandable segments: one address range per pool and
// stream, pages mapped into it as blocks need them and unmapped again when whole pages are free.
#include <algorithm>
#include <memory>

#include "memory/caching_policy.h"
#include "memory/caching_policy_blocks.h"

namespace headroom {

CachingPolicy::Block* CachingPolicy::try_allocate_expandable(Request& r) {
  Block* c = find_expandable(*r.pool, r.stream, r.size);
  if (c == nullptr) {
    r.device_refused = true;
    return nullptr;
  }
  // Either unmapped address space, or a free mapped block followed by it. A page the source cannot
  // map is the machine's memory running out (the cap was checked before).
  if (!c->mapped && !map_block(c, std::min(c->size, r.size))) {
    r.device_refused = true;
    return nullptr;
  }
  while (c->size < r.size) {
    const int64_t missing = r.size - c->size;
    Block* unmapped = c->next;
    if (!map_block(unmapped, std::min(missing, unmapped->size))) {
      r.device_refused = true;
      return nullptr;
    }
    c = unmapped;  // it took in the mapped block before it
  }
  r.pool->blocks.erase(c);
  return c;
}

CachingPolicy::Block* CachingPolicy::find_expandable(Pool& pool, int stream, int64_t size) {
  auto allocatable = [](const Block* b) { return b != nullptr && !b->allocated; };
  auto has_room = [&](const Block* b) {
    int64_t bytes = 0;
    while (bytes < size && allocatable(b)) {
      bytes += b->size;
      b = b->next;
    }
    return bytes >= size;
  };
  Block key;
  key.stream = stream;
  for (auto it = pool.unmapped.lower_bound(&key); it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
    Block* c = *it;
    // The lowest unmapped range, with the free mapped block just before it when there is one.
    if (allocatable(c->prev)) c = c->prev;
    if (has_room(c)) return c;
  }
  auto e = std::make_unique<Expandable>();
  e->page = pool.small ? kSmallBuffer : kLargeBuffer;
  // Address space for 1 1/8 of the device, as the reference reserves (room to map pages at the end
  // while earlier ones are still in use); without a cap, 1 TiB.
  const int64_t device = limit_.value_or(int64_t{1} << 40);
  e->size = round_up_to(device + device / 8, e->page);
  e->base = take_address(e->size);
  if (!source_->reserve(e->base, e->size)) return nullptr;
  auto* c = new Block;
  c->address = e->base;
  c->size = e->size;
  c->stream = stream;
  c->pool = &pool;
  c->mapped = false;
  c->expandable = e.get();
  pool.unmapped.insert(c);
  expandable_.push_back(std::move(e));
  return c;
}

bool CachingPolicy::map_block(Block* b, int64_t size) {
  const Expandable& e = *b->expandable;
  const int64_t bytes =
      round_up_to(static_cast<int64_t>(b->address - e.base) + size, e.page) - static_cast<int64_t>(b->address - e.base);
  // No cap here, as in the reference: alloc_block checked the request's segment size, and a mapping
  // rounded up to a page may pass the cap by less than a page.
  if (!source_->map(b->address, bytes)) return false;
  Pool& pool = *b->pool;
  pool.unmapped.erase(b);
  b->mapped = true;
  if (bytes < b->size) {
    auto* rest = new Block;
    rest->address = b->address + static_cast<uint64_t>(bytes);
    rest->size = b->size - bytes;
    rest->stream = b->stream;
    rest->pool = &pool;
    rest->mapped = false;
    rest->expandable = b->expandable;
    rest->splice(b, b->next);
    pool.unmapped.insert(rest);
    b->size = bytes;
  }
  try_merge(b, b->prev, pool);
  try_merge(b, b->next, pool);
  pool.insert(b);
  total_reserved_ += bytes;
  stats_.reserved_bytes.add(bytes);
  ++stats_.num_device_alloc;
  emit(TraceAction::segment_map, b->address, bytes, b->stream);
  return true;
}

void CachingPolicy::unmap_block(Block* b) {
  const Expandable& e = *b->expandable;
  const auto offset = static_cast<int64_t>(b->address - e.base);
  const int64_t begin = round_up_to(offset, e.page);
  const int64_t end = (offset + b->size) / e.page * e.page;
  if (begin >= end) return;  // no whole page inside it
  const uint64_t first = e.base + static_cast<uint64_t>(begin);
  const int64_t bytes = end - begin;
  source_->unmap(first, bytes);
  Pool& pool = *b->pool;
  pool.blocks.erase(b);
  const int64_t before = begin - offset;
  if (before > 0) {
    auto* head = new Block;
    head->address = b->address;
    head->size = before;
    head->stream = b->stream;
    head->pool = &pool;
    head->expandable = b->expandable;
    head->splice(b->prev, b);
    pool.insert(head);
  }
  const int64_t after = b->size - before - bytes;
  if (after > 0) {
    auto* tail = new Block;
    tail->address = first + static_cast<uint64_t>(bytes);
    tail->size = after;
    tail->stream = b->stream;
    tail->pool = &pool;
    tail->expandable = b->expandable;
    tail->splice(b, b->next);
    pool.insert(tail);
  }
  b->address = first;
  b->size = bytes;
  b->mapped = false;
  try_merge(b, b->prev, pool);
  try_merge(b, b->next, pool);
  pool.unmapped.insert(b);
  total_reserved_ -= bytes;
  stats_.reserved_bytes.sub(bytes);
  ++stats_.num_device_free;
  emit(TraceAction::segment_unmap, first, bytes, b->stream);
}

}  // namespace headroom
