#include "memory/caching_policy.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>
#include <set>

#include "memory/caching_policy_blocks.h"

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

namespace {
constexpr uint64_t kFirstAddress = uint64_t{1} << 40;
constexpr int64_t kAddressAlignment = int64_t{2} << 20;

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
  return round_up_to(bytes, kMinBlockSize);
}

int64_t CachingPolicy::allocation_size(int64_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return round_up_to(rounded, kRoundLarge);
}

CachingPolicy::Pool& CachingPolicy::pool_for(int64_t rounded) { return rounded <= kSmallSize ? *small_ : *large_; }

void CachingPolicy::emit(TraceAction a, uint64_t address, int64_t size, int stream) {
  if (observer_) observer_({a, address, size, stream});
}

uint64_t CachingPolicy::take_address(int64_t bytes) {
  const uint64_t address = next_address_;
  next_address_ += static_cast<uint64_t>(round_up_to(bytes, kAddressAlignment));
  return address;
}

// ---- requests: the best fit of the request's pool and stream from the cache, split when the rest
// is worth keeping, else a new segment (caching_policy_segments.cpp); a free merges the block with
// its free neighbours ----

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
    auto growable = [](const Block* b) {
      return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0);
    };
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

// ---- what the policy holds ----

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
