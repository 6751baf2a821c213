#include "memory/caching_policy.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>

namespace headroom {

void CachingStats::Stat::add(int64_t n) {
  current += n;
  allocated += n;
  peak = std::max(peak, current);
}

void CachingStats::Stat::sub(int64_t n) {
  current -= n;
  freed += n;
}

void CachingStats::reset_peaks() {
  for (Stat* s : {&allocated_bytes, &reserved_bytes, &active_bytes, &inactive_split_bytes, &requested_bytes,
                  &allocation, &segment, &active, &inactive_split}) {
    s->peak = s->current;
  }
}

const char* trace_action_name(TraceAction a) {
  switch (a) {
    case TraceAction::alloc: return "alloc";
    case TraceAction::free_requested: return "free_requested";
    case TraceAction::free_completed: return "free_completed";
    case TraceAction::segment_alloc: return "segment_alloc";
    case TraceAction::segment_free: return "segment_free";
    case TraceAction::segment_map: return "segment_map";
    case TraceAction::segment_unmap: return "segment_unmap";
    case TraceAction::oom: return "oom";
  }
  return "?";
}

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

namespace {
// Best fit: stream, then size, then address (a search key has address 0).
struct BySize {
  bool operator()(const CachingPolicy::Block* a, const CachingPolicy::Block* b) const;
};
struct ByAddress {
  bool operator()(const CachingPolicy::Block* a, const CachingPolicy::Block* b) const;
};
}  // namespace

bool BySize::operator()(const CachingPolicy::Block* a, const CachingPolicy::Block* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  return a->address < b->address;
}
bool ByAddress::operator()(const CachingPolicy::Block* a, const CachingPolicy::Block* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  return a->address < b->address;
}

struct CachingPolicy::Pool {
  bool small = false;
  std::set<Block*, BySize> blocks;        // free, mapped
  std::set<Block*, ByAddress> unmapped;   // expandable address space without pages
  int64_t searches = 0;                   // get_free_block calls, the garbage collector's clock

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

namespace {
constexpr uint64_t kFirstAddress = uint64_t{1} << 40;
constexpr int64_t kAddressAlignment = int64_t{2} << 20;
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The next size of `divisions` equal steps between the powers of two around `size`.
int64_t roundup_power2_next_division(int64_t size, int64_t divisions) {
  const auto s = static_cast<uint64_t>(size);
  if (std::has_single_bit(s)) return size;
  const uint64_t floor = std::bit_floor(s);
  const uint64_t step = floor >> (std::bit_width(static_cast<uint64_t>(divisions)) - 1);
  if (step == 0) return static_cast<int64_t>(floor << 1);
  const uint64_t rounded_floor = s & ~(step - 1);
  return static_cast<int64_t>(rounded_floor == s ? s : rounded_floor + step);
}
}  // namespace

CachingPolicy::CachingPolicy(AllocatorConfig config, std::optional<int64_t> limit, SegmentSource* source)
    : config_(std::move(config)),
      limit_(limit),
      source_(source),
      small_(std::make_unique<Pool>()),
      large_(std::make_unique<Pool>()),
      next_address_(kFirstAddress) {
  if (source_ == nullptr) {
    default_source_ = std::make_unique<SegmentSource>();
    source_ = default_source_.get();
  }
  small_->small = true;
}

CachingPolicy::~CachingPolicy() {
  std::set<Block*> all;
  for (Pool* p : {small_.get(), large_.get()}) {
    all.insert(p->blocks.begin(), p->blocks.end());
    all.insert(p->unmapped.begin(), p->unmapped.end());
  }
  for (const auto& [address, b] : allocated_) all.insert(b);
  for (Block* b : all) delete b;
}

int64_t CachingPolicy::round_size(int64_t bytes) const {
  if (bytes < kMinBlockSize) return kMinBlockSize;
  const int64_t divisions = config_.divisions_for(bytes);
  if (divisions > 1 && bytes > kMinBlockSize * divisions) return roundup_power2_next_division(bytes, divisions);
  return round_up(bytes, kMinBlockSize);
}

int64_t CachingPolicy::allocation_size(int64_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return round_up(rounded, kRoundLarge);
}

CachingPolicy::Pool& CachingPolicy::pool_for(int64_t rounded) { return rounded <= kSmallSize ? *small_ : *large_; }

void CachingPolicy::emit(TraceAction a, uint64_t address, int64_t size, int stream) {
  if (observer_) observer_({a, address, size, stream});
}

uint64_t CachingPolicy::take_address(int64_t bytes) {
  const uint64_t address = next_address_;
  next_address_ += static_cast<uint64_t>(round_up(bytes, kAddressAlignment));
  return address;
}

std::optional<uint64_t> CachingPolicy::allocate(int64_t bytes, int stream) {
  TORCH_CHECK(bytes >= 0, "CachingPolicy::allocate: negative size ", bytes);
  Request r;
  r.requested = bytes;
  r.size = round_size(bytes);
  r.stream = stream;
  r.pool = &pool_for(r.size);
  r.alloc_size = allocation_size(r.size);
  bool found = get_free_block(r);
  if (!found) {
    if (limit_ && config_.garbage_collection_threshold > 0) garbage_collect();
    found = alloc_block(r, false) || (release_available_cached_blocks(r) && alloc_block(r, false)) ||
            (release_cached_blocks() && alloc_block(r, true));
  }
  if (!found) {
    ++stats_.num_ooms;
    CachingOom oom;
    oom.requested = bytes;
    oom.rounded = r.size;
    oom.segment_bytes = r.alloc_size;
    oom.allocated = stats_.allocated_bytes.current;
    oom.reserved = stats_.reserved_bytes.current;
    oom.limit = limit_.value_or(-1);
    oom.device_refused = r.device_refused;
    oom.expandable = config_.expandable_segments;
    last_oom_ = oom;
    // As the reference records it: the request's size, and where the address goes, the free bytes.
    emit(TraceAction::oom, limit_ ? static_cast<uint64_t>(std::max<int64_t>(0, *limit_ - total_reserved_)) : 0, r.size,
         stream);
    return std::nullopt;
  }
  return found_block(r);
}

bool CachingPolicy::get_free_block(Request& r) {
  Pool& pool = *r.pool;
  if (limit_ && config_.garbage_collection_threshold > 0) ++pool.searches;
  Block key;
  key.stream = r.stream;
  key.size = r.size;
  auto it = pool.blocks.lower_bound(&key);
  if (it == pool.blocks.end() || (*it)->stream != r.stream) return false;
  if ((*it)->expandable != nullptr && config_.expandable_segments) {
    // A block that ends where unmapped address space begins can grow into it: for the best fit its
    // size is what it can grow to.
    auto growable = [](const Block* b) { return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0); };
    auto next = std::next(it);
    while ((*it)->expandable != nullptr && next != pool.blocks.end() && (*next)->stream == r.stream &&
           growable(*next) < growable(*it)) {
      it = next++;
    }
  } else if ((*it)->expandable != nullptr) {
    // Expandable segments switched off after some were made: only fixed blocks serve from now on.
    do {
      ++it;
    } while (it != pool.blocks.end() && (*it)->expandable != nullptr && (*it)->stream == r.stream);
    if (it == pool.blocks.end() || (*it)->stream != r.stream) return false;
  }
  // An oversize block serves neither a smaller request nor one much smaller than itself.
  if (r.size < config_.max_split_size && (*it)->size >= config_.max_split_size) return false;
  if (r.size >= config_.max_split_size && (*it)->size >= r.size + config_.max_non_split_rounding_size) return false;
  r.block = *it;
  pool.blocks.erase(it);
  return true;
}

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

bool CachingPolicy::should_split(const Block* b, int64_t size) const {
  const int64_t remaining = b->size - size;
  if (b->pool->small || config_.expandable_segments) return remaining >= kMinBlockSize;
  return size < config_.max_split_size && remaining > kSmallSize;
}

uint64_t CachingPolicy::found_block(Request& r) {
  Block* block = r.block;
  Pool& pool = *r.pool;
  const bool already_split = block->is_split();
  if (should_split(block, r.size)) {
    Block* remaining = block;
    block = new Block;
    block->address = remaining->address;
    block->size = r.size;
    block->stream = r.stream;
    block->pool = &pool;
    block->expandable = remaining->expandable;
    block->prev = remaining->prev;
    if (block->prev != nullptr) block->prev->next = block;
    block->next = remaining;
    remaining->prev = block;
    remaining->address += static_cast<uint64_t>(r.size);
    remaining->size -= r.size;
    pool.insert(remaining);
    if (block->expandable == nullptr) {
      if (already_split) {
        stats_.inactive_split_bytes.sub(block->size);  // a split free block shrank by the request
      } else {
        stats_.inactive_split_bytes.add(remaining->size);  // a whole segment became split
        stats_.inactive_split.add(1);
      }
    }
  } else if (already_split && block->expandable == nullptr) {
    stats_.inactive_split_bytes.sub(block->size);
    stats_.inactive_split.sub(1);
  }
  block->allocated = true;
  block->requested = r.requested;
  allocated_.emplace(block->address, block);
  stats_.allocation.add(1);
  stats_.allocated_bytes.add(block->size);
  stats_.active.add(1);
  stats_.active_bytes.add(block->size);
  stats_.requested_bytes.add(r.requested);
  emit(TraceAction::alloc, block->address, r.requested, r.stream);
  return block->address;
}

void CachingPolicy::free(uint64_t address) {
  auto it = allocated_.find(address);
  TORCH_CHECK(it != allocated_.end(), "CachingPolicy::free: no allocated block at ", address);
  Block* b = it->second;
  allocated_.erase(it);
  const int64_t requested = b->requested;
  const int stream = b->stream;
  emit(TraceAction::free_requested, address, requested, stream);
  stats_.allocation.sub(1);
  stats_.allocated_bytes.sub(b->size);
  free_block(b);
  emit(TraceAction::free_completed, address, requested, stream);
}

int64_t CachingPolicy::try_merge(Block* dst, Block* src, Pool& pool) {
  if (src == nullptr || src->allocated || dst->mapped != src->mapped) return 0;
  if (dst->prev == src) {
    dst->address = src->address;
    dst->prev = src->prev;
    if (dst->prev != nullptr) dst->prev->next = dst;
  } else {
    dst->next = src->next;
    if (dst->next != nullptr) dst->next->prev = dst;
  }
  const int64_t subsumed = src->size;
  dst->size += subsumed;
  if (src->mapped) {
    pool.blocks.erase(src);
  } else {
    pool.unmapped.erase(src);
  }
  delete src;
  return subsumed;
}

void CachingPolicy::free_block(Block* b) {
  b->allocated = false;
  const int64_t original = b->size;
  const int64_t requested = b->requested;
  b->requested = 0;
  Pool& pool = *b->pool;
  int64_t net_blocks = 0, net_bytes = 0;
  for (Block* candidate : {b->prev, b->next}) {
    const int64_t subsumed = try_merge(b, candidate, pool);
    if (subsumed > 0) {
      net_blocks -= 1;
      net_bytes -= subsumed;
    }
  }
  pool.insert(b);
  if (b->is_split()) {
    net_blocks += 1;
    net_bytes += b->size;
  }
  if (b->expandable == nullptr) {
    if (net_blocks > 0) stats_.inactive_split.add(net_blocks);
    if (net_blocks < 0) stats_.inactive_split.sub(-net_blocks);
    if (net_bytes > 0) stats_.inactive_split_bytes.add(net_bytes);
    if (net_bytes < 0) stats_.inactive_split_bytes.sub(-net_bytes);
  }
  stats_.active.sub(1);
  stats_.active_bytes.sub(original);
  stats_.requested_bytes.sub(requested);
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
  const auto threshold =
      static_cast<int64_t>(config_.garbage_collection_threshold * static_cast<double>(*limit_));
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
  e->size = round_up(device + device / 8, e->page);
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
  const int64_t bytes = round_up(static_cast<int64_t>(b->address - e.base) + size, e.page) -
                        static_cast<int64_t>(b->address - e.base);
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

void CachingPolicy::unmap_block(Block* b) {
  const Expandable& e = *b->expandable;
  const auto offset = static_cast<int64_t>(b->address - e.base);
  const int64_t begin = round_up(offset, e.page);
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

std::vector<SegmentInfo> CachingPolicy::segments() const {
  std::vector<const Block*> mapped;
  for (const Pool* p : {small_.get(), large_.get()}) mapped.insert(mapped.end(), p->blocks.begin(), p->blocks.end());
  for (const auto& [address, b] : allocated_) mapped.push_back(b);
  std::sort(mapped.begin(), mapped.end(), [](const Block* a, const Block* b) { return a->address < b->address; });
  std::vector<SegmentInfo> out;
  // One segment per contiguous mapped range (an expandable segment's mapped runs each count as one).
  for (const Block* head : mapped) {
    if (head->prev != nullptr && head->prev->mapped) continue;
    SegmentInfo s;
    s.address = head->address;
    s.stream = head->stream;
    s.small = head->pool->small;
    s.expandable = head->expandable != nullptr;
    for (const Block* b = head; b != nullptr && b->mapped; b = b->next) {
      s.blocks.push_back({b->address, b->size, b->requested, b->allocated});
      s.total_size += b->size;
    }
    out.push_back(std::move(s));
  }
  return out;
}

int64_t CachingPolicy::largest_free_block() const {
  int64_t largest = 0;
  for (const Pool* p : {small_.get(), large_.get()}) {
    for (const Block* b : p->blocks) largest = std::max(largest, b->size);
  }
  return largest;
}

}  // namespace headroom
