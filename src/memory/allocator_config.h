// AllocatorConfig — the caching allocator's settings, read from PYTORCH_CUDA_ALLOC_CONF's syntax.
//
// The options that change where memory goes, with their meaning and defaults in PyTorch 2.11 to 2.15
// (c10/cuda/CUDACachingAllocator.cpp and its config parser; unchanged between those releases):
//   max_split_size_mb:N            blocks of N MiB or more are never split; a request below N is never
//                                  served by one, a larger request only by one less than 20 MiB larger
//                                  (max_non_split_rounding_mb); N is at least 20. Default: unlimited.
//   max_non_split_rounding_mb:N    that 20 MiB.
//   roundup_power2_divisions:D     sizes are rounded up to one of D steps between powers of two
//   roundup_power2_divisions:[256:1,512:2,>:8]   ... per size range (keys in MiB, powers of two)
//   garbage_collection_threshold:T with a memory cap, cached unsplit blocks are freed oldest first once
//                                  reserved memory passes T of the cap (0 < T < 1).
//   expandable_segments:True       one growing mapping per pool and stream instead of fixed segments.
// Options that change nothing here (backend:native, release_lock_on_cudamalloc, pinned_*, and with
// torch 2.15 throw_on_cudamalloc_oom and expandable_segments_reserve*, which the linked torch's
// parser decides) are accepted and kept in `ignored`; backend:cudaMallocAsync (a different allocator) and a
// large_segment_size_mb other than 20 are refused: the model would not hold for them.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace headroom {

inline constexpr int kRoundupIntervals = 16;  // 1 MiB, 2 MiB, ... 32 GiB and above

struct AllocatorConfig {
  int64_t max_split_size = std::numeric_limits<int64_t>::max();
  int64_t max_non_split_rounding_size = int64_t{20} << 20;
  // Per power-of-two interval starting at 1 MiB (the first also covers smaller sizes); 0: none.
  std::array<int64_t, kRoundupIntervals> roundup_power2_divisions{};
  double garbage_collection_threshold = 0;  // 0: off
  bool expandable_segments = false;
  std::vector<std::string> ignored;  // accepted options without an effect here

  // Divisions for a block of `bytes` (0: plain 512-byte rounding).
  int64_t divisions_for(int64_t bytes) const;
  // PyTorch's syntax back, modeled options only, e.g. "expandable_segments:True" ("" for defaults).
  std::string text() const;
};

// Parses "key:value,key:value" as PyTorch does; throws Error naming the option and what it accepts.
// `source` names where the text came from in messages ("PYTORCH_CUDA_ALLOC_CONF", "--allocator-conf").
AllocatorConfig parse_allocator_config(const std::string& text, const std::string& source);

// Checks `text` as PyTorch's own parser will, without modelling it: what PyTorch accepts passes
// (backend:cudaMallocAsync and large_segment_size_mb too); anything else throws Error naming the
// option and the keys accepted. The launcher's check of the environment (cli/environment_check.cpp).
void check_allocator_config(const std::string& text, const std::string& source);

// The settings in the environment: PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF (PyTorch reads
// the same two), "" when neither is set.
std::string allocator_config_from_environment();

}  // namespace headroom
