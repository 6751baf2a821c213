// CachingPolicy — PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, 2.11 to 2.15), its
// decisions without its memory: which block serves a request, when a segment is taken from the
// device or given back, how blocks split and merge. Written once and used three ways: by the cpu
// caching allocator (memory/caching_heap.h) over real host memory, by the estimator over its
// symbolic allocation sequence (so a prediction of reserved bytes is the same code as the
// measurement), and by the policy tests and the GPU check over recorded traces.
//
// The rules, as the reference has them:
//   - sizes are rounded up to 512 bytes (or to roundup_power2_divisions steps);
//   - requests up to 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the
//     large pool: a 20 MiB segment below 10 MiB, else the size rounded up to 2 MiB;
//   - the best fit (smallest block, then the earliest segment, then lowest address) of the request's
//     pool and stream serves it (2.15 orders equal sizes by a counter of segment creation, 2.11 by
//     address; with the bump pointer below both are the address order, as on cuda only 2.15 is);
//     a block of max_split_size or more never serves a smaller request, nor one more than
//     max_non_split_rounding smaller than itself;
//   - a block is split when the rest is at least 512 bytes (small pool, expandable segments) or
//     more than 1 MiB (large pool, requests below max_split_size); freed blocks merge with free
//     neighbours of their segment;
//   - when no cached block fits: with a cap and garbage_collection_threshold, old unsplit blocks are
//     freed first; then a new segment is taken, refused when reserved bytes plus its size would pass
//     the cap (a memory fraction on cuda, --memory-budget here); if that fails, cached oversize blocks are freed and it
//     is retried, then every unsplit cached block is freed and it is retried once more (counted in
//     num_alloc_retries); then the request fails (num_ooms);
//   - expandable_segments: each pool and stream has one address range, mapped and unmapped in pages
//     (2 MiB small, 20 MiB large) as blocks need them, so splitting never strands a segment's tail
//     (the cap is checked on the request's segment size, so a page-rounded mapping may pass it by
//     less than a page, as on cuda);
//   - empty_cache frees every segment without a live block (and unmaps free pages).
// Addresses are the policy's own (a bump pointer from 1 TiB, segments 2 MiB aligned): the same
// sequence of calls always makes the same decisions, whatever memory backs them.
//
// One stream per call (0 on cpu). Not thread-safe: the owner serialises calls.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "memory/allocator_config.h"

namespace headroom {

inline constexpr int64_t kMinBlockSize = 512;
inline constexpr int64_t kSmallSize = int64_t{1} << 20;
inline constexpr int64_t kSmallBuffer = int64_t{2} << 20;
inline constexpr int64_t kMinLargeAlloc = int64_t{10} << 20;
inline constexpr int64_t kRoundLarge = int64_t{2} << 20;
inline constexpr int64_t kLargeBuffer = int64_t{20} << 20;

// Where segments' memory comes from (the driver's part). Each call may fail (false) when the
// memory is not there; the cap is the policy's, not the source's. The default source has unlimited
// memory and backs nothing (the estimator's and the tests').
class SegmentSource {
 public:
  virtual ~SegmentSource() = default;
  virtual bool allocate(uint64_t /*address*/, int64_t /*bytes*/) { return true; }  // cudaMalloc
  virtual void free(uint64_t /*address*/, int64_t /*bytes*/) {}                   // cudaFree
  // Expandable segments: address space first, then pages mapped into it and unmapped again.
  virtual bool reserve(uint64_t /*address*/, int64_t /*bytes*/) { return true; }
  virtual void unreserve(uint64_t /*address*/, int64_t /*bytes*/) {}
  virtual bool map(uint64_t /*address*/, int64_t /*bytes*/) { return true; }
  virtual void unmap(uint64_t /*address*/, int64_t /*bytes*/) {}
};

// torch.cuda.memory_stats()'s figures, all pools together ("all" in its keys), current and peak.
struct CachingStats {
  struct Stat {
    int64_t current = 0, peak = 0, allocated = 0, freed = 0;
    void add(int64_t n);
    void sub(int64_t n);
  };
  Stat allocated_bytes;       // blocks handed out, at their (rounded) block size
  Stat reserved_bytes;        // segments (mapped pages) held from the device
  Stat active_bytes;          // allocated blocks (no cross-stream frees pending on cpu)
  Stat inactive_split_bytes;  // free blocks inside segments that are split (not expandable ones)
  Stat requested_bytes;       // what the callers asked for, before rounding
  Stat allocation, segment, active, inactive_split;  // counts
  int64_t num_alloc_retries = 0;
  int64_t num_ooms = 0;
  int64_t num_device_alloc = 0;  // segments allocated or pages mapped
  int64_t num_device_free = 0;
  void reset_peaks();
};

// One event of the allocator's history, as torch.cuda.memory._snapshot()'s device_traces have them.
enum class TraceAction { alloc, free_requested, free_completed, segment_alloc, segment_free, segment_map,
                         segment_unmap, oom };
const char* trace_action_name(TraceAction a);

struct TraceEvent {
  TraceAction action = TraceAction::alloc;
  uint64_t address = 0;
  int64_t size = 0;  // block or segment bytes; for oom, the request
  int stream = 0;
};

// A segment and its blocks, as the snapshot lists them.
struct BlockInfo {
  uint64_t address = 0;
  int64_t size = 0;
  int64_t requested = 0;  // 0 when free
  bool allocated = false;
};
struct SegmentInfo {
  uint64_t address = 0;
  int64_t total_size = 0;  // mapped bytes for an expandable segment
  int stream = 0;
  bool small = false;
  bool expandable = false;
  std::vector<BlockInfo> blocks;  // in address order
};

// What a failed allocation met: the request, and the allocator as it was (for the message).
struct CachingOom {
  int64_t requested = 0;      // as asked
  int64_t rounded = 0;        // the block size it needed
  int64_t segment_bytes = 0;  // the segment it tried to take
  int64_t allocated = 0;
  int64_t reserved = 0;
  int64_t limit = -1;  // -1: none
  bool device_refused = false;  // the source had no memory, rather than the cap being reached
  bool expandable = false;      // expandable segments were on
};

class CachingPolicy {
 public:
  // `limit`: the most it may reserve (a memory fraction's cap; none: only the source limits it).
  // `source` must outlive the policy; null: unlimited and unbacked.
  explicit CachingPolicy(AllocatorConfig config = {}, std::optional<int64_t> limit = std::nullopt,
                         SegmentSource* source = nullptr);
  ~CachingPolicy();
  CachingPolicy(const CachingPolicy&) = delete;
  CachingPolicy& operator=(const CachingPolicy&) = delete;

  struct Block;

  // A block of at least `bytes` (a 0-byte request gets a 512-byte block; callers that follow
  // PyTorch pass none, as its allocator hands out no block for 0 bytes), or nullopt when out of memory
  // (last_oom() says why). The address stays valid until free().
  std::optional<uint64_t> allocate(int64_t bytes, int stream = 0);
  void free(uint64_t address);
  // Returns every cached block that holds no live allocation to the source.
  void empty_cache();

  void set_limit(std::optional<int64_t> limit) { limit_ = limit; }
  // New settings from now on, as setAllocatorSettings applies them: blocks already cut stay.
  void set_config(const AllocatorConfig& config) { config_ = config; }
  std::optional<int64_t> limit() const { return limit_; }
  const AllocatorConfig& config() const { return config_; }
  const CachingStats& stats() const { return stats_; }
  void reset_peaks() { stats_.reset_peaks(); }
  const std::optional<CachingOom>& last_oom() const { return last_oom_; }

  std::vector<SegmentInfo> segments() const;
  // The largest cached free block (what could serve a request without a new segment).
  int64_t largest_free_block() const;
  // Called for every event as it happens (the snapshot's history).
  void set_observer(std::function<void(const TraceEvent&)> observer) { observer_ = std::move(observer); }

  // The rules, exposed for tests and for the estimator's reports.
  int64_t round_size(int64_t bytes) const;
  static int64_t allocation_size(int64_t rounded);

 private:
  struct Pool;
  struct Expandable;
  struct Request;

  Pool& pool_for(int64_t rounded);
  bool get_free_block(Request& r);
  bool alloc_block(Request& r, bool retry);
  bool release_available_cached_blocks(Request& r);
  bool release_cached_blocks();
  void release_blocks(Pool& pool);
  void release_block(Block* b);
  void garbage_collect();
  uint64_t found_block(Request& r);
  bool should_split(const Block* b, int64_t size) const;
  int64_t try_merge(Block* dst, Block* src, Pool& pool);
  void free_block(Block* b);
  Block* try_allocate_expandable(Request& r);
  Block* find_expandable(Pool& pool, int stream, int64_t size);
  bool map_block(Block* b, int64_t size);
  void unmap_block(Block* b);
  uint64_t take_address(int64_t bytes);
  void emit(TraceAction a, uint64_t address, int64_t size, int stream);

  AllocatorConfig config_;
  std::optional<int64_t> limit_;
  SegmentSource* source_;
  std::unique_ptr<SegmentSource> default_source_;
  std::unique_ptr<Pool> small_, large_;
  std::map<uint64_t, Block*> allocated_;  // live blocks by address
  std::vector<std::unique_ptr<Expandable>> expandable_;
  int64_t total_reserved_ = 0;
  uint64_t next_address_;
  CachingStats stats_;
  std::optional<CachingOom> last_oom_;
  std::function<void(const TraceEvent&)> observer_;
};

}  // namespace headroom
