#include "memory/allocator_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>

#include <torch/headeronly/version.h>

#include "util/error.h"

namespace headroom {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kLargeBufferMiB = 20;

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// Splits on `sep` outside brackets.
std::vector<std::string> split_top(const std::string& text, char sep, const std::string& source) {
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  for (char ch : text) {
    if (ch == '[') ++depth;
    if (ch == ']' && --depth < 0) fail("{} '{}': a ']' without its '['", source, text);
    if (ch == sep && depth == 0) {
      out.push_back(trim(cur));
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (depth != 0) fail("{} '{}': a '[' without its ']'", source, text);
  out.push_back(trim(cur));
  return out;
}

int64_t parse_count(const std::string& key, const std::string& value, const std::string& source) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno != 0 || v < 0) {
    fail("{}: {} '{}' is not a non-negative whole number", source, key, value);
  }
  return v;
}

bool parse_bool(const std::string& key, const std::string& value, const std::string& source) {
  if (value == "True") return true;
  if (value == "False") return false;
  fail("{}: {} '{}': accepted: True or False", source, key, value);
}

int64_t parse_divisions(const std::string& value, const std::string& source) {
  const int64_t d = parse_count("roundup_power2_divisions", value, source);
  if (d != 0 && !std::has_single_bit(static_cast<uint64_t>(d))) {
    fail("{}: roundup_power2_divisions {} must be a power of 2 (or 0: off)", source, d);
  }
  return d;
}

// "[256:1,512:2,>:8]": from each key's size (MiB, a power of two) up to the next, the given divisions;
// ">" covers the rest. Intervals below the first key take its divisions, as PyTorch does.
void parse_divisions_list(AllocatorConfig& c, const std::string& value, const std::string& source) {
  const std::string inner = value.substr(1, value.size() - 2);
  int last = 0;  // as PyTorch starts it: a leading ">" fills from the second interval
  bool first = true;
  for (const std::string& item : split_top(inner, ',', source)) {
    const auto colon = item.find(':');
    if (colon == std::string::npos) {
      fail("{}: roundup_power2_divisions entry '{}': expected SIZE_MB:DIVISIONS or >:DIVISIONS", source, item);
    }
    const std::string key = trim(item.substr(0, colon));
    const int64_t divisions = parse_divisions(trim(item.substr(colon + 1)), source);
    if (key == ">") {
      for (int i = last + 1; i < kRoundupIntervals; ++i) c.roundup_power2_divisions[i] = divisions;
      last = kRoundupIntervals - 1;
      continue;
    }
    const int64_t mb = parse_count("roundup_power2_divisions", key, source);
    if (mb == 0 || !std::has_single_bit(static_cast<uint64_t>(mb))) {
      fail("{}: roundup_power2_divisions size {} must be a power of 2 in MiB", source, key);
    }
    const int index = std::min(kRoundupIntervals - 1, static_cast<int>(std::bit_width(static_cast<uint64_t>(mb))) - 1);
    if (index <= last && !first) {
      fail("{}: roundup_power2_divisions sizes must increase, got {} after a larger one", source, key);
    }
    if (first) {
      for (int i = 0; i < index; ++i) c.roundup_power2_divisions[i] = divisions;
    }
    c.roundup_power2_divisions[index] = divisions;
    last = index;
    first = false;
  }
}

}  // namespace

int64_t AllocatorConfig::divisions_for(int64_t bytes) const {
  const int log_size = static_cast<int>(std::bit_width(static_cast<uint64_t>(bytes))) - 1;
  const int index = std::clamp(log_size - 20, 0, kRoundupIntervals - 1);
  return roundup_power2_divisions[static_cast<size_t>(index)];
}

std::string AllocatorConfig::text() const {
  std::vector<std::string> parts;
  if (max_split_size != std::numeric_limits<int64_t>::max()) parts.push_back(fmt::format("max_split_size_mb:{}", max_split_size / kMiB));
  if (max_non_split_rounding_size != kLargeBufferMiB * kMiB) {
    parts.push_back(fmt::format("max_non_split_rounding_mb:{}", max_non_split_rounding_size / kMiB));
  }
  const auto& d = roundup_power2_divisions;
  const bool uniform = std::all_of(d.begin(), d.end(), [&](int64_t v) { return v == d[0]; });
  if (uniform && d[0] != 0) {
    parts.push_back(fmt::format("roundup_power2_divisions:{}", d[0]));
  } else if (!uniform) {
    // In PyTorch's list, a key (an interval's size in MiB) sets its own interval, the first key also
    // every one below it, and ">" every one after the last key: the first run by its last interval,
    // the middle intervals one by one, the last run by its first interval and ">".
    std::vector<std::string> items;
    int first_end = 0, last_start = kRoundupIntervals - 1;
    while (first_end + 1 < kRoundupIntervals && d[first_end + 1] == d[0]) ++first_end;
    while (last_start > 0 && d[last_start - 1] == d[kRoundupIntervals - 1]) --last_start;
    for (int i = first_end; i <= last_start; ++i) items.push_back(fmt::format("{}:{}", int64_t{1} << i, d[i]));
    if (last_start < kRoundupIntervals - 1) items.push_back(fmt::format(">:{}", d[last_start]));
    parts.push_back(fmt::format("roundup_power2_divisions:[{}]", fmt::join(items, ",")));
  }
  if (garbage_collection_threshold > 0) parts.push_back(fmt::format("garbage_collection_threshold:{}", garbage_collection_threshold));
  if (expandable_segments) parts.push_back("expandable_segments:True");
  return fmt::format("{}", fmt::join(parts, ","));
}

namespace {

// The keys the linked PyTorch's parsers accept (c10/core/AllocatorConfig.h,
// c10/cuda/CUDAAllocatorConfig.h), for messages: 2.11's, and from 2.15 the pinned pool's limits, the
// pre-emptive OOM and the expandable segments' address reserve.
constexpr bool kTorch215 = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 15);
constexpr const char* kAcceptedKeys =
    kTorch215 ? "max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions, garbage_collection_threshold, "
                "expandable_segments, large_segment_size_mb, backend, release_lock_on_cudamalloc, "
                "release_lock_on_hipmalloc, pinned_use_cuda_host_register, pinned_use_hip_host_register, "
                "pinned_num_register_threads, pinned_use_background_threads, "
                "pinned_reserve_segment_size_mb, pinned_max_round_threshold_mb, pinned_max_cached_size_mb, "
                "pinned_free_catch_all, graph_capture_record_stream_reuse, per_process_memory_fraction, "
                "throw_on_cudamalloc_oom, expandable_segments_reserve, expandable_segments_reserve_by_class"
              : "max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions, garbage_collection_threshold, "
                "expandable_segments, large_segment_size_mb, backend, release_lock_on_cudamalloc, "
                "release_lock_on_hipmalloc, pinned_use_cuda_host_register, pinned_use_hip_host_register, "
                "pinned_num_register_threads, pinned_use_background_threads, "
                "pinned_reserve_segment_size_mb, graph_capture_record_stream_reuse, per_process_memory_fraction";

// PyTorch 2.15's keys that change nothing headroom models, checked as 2.15 checks them: the pinned
// pool's limits are whole MiB counts, the two switches True or False; a malformed address reserve
// only makes PyTorch warn and keep its default, so any value passes (a reserve class list needs its
// brackets). True when `key` is one of them.
bool apply_torch215_key(const std::string& key, const std::string& value, const std::string& source) {
  if (!kTorch215) return false;
  if (key == "pinned_max_round_threshold_mb" || key == "pinned_max_cached_size_mb") {
    parse_count(key, value, source);
  } else if (key == "pinned_free_catch_all" || key == "throw_on_cudamalloc_oom") {
    parse_bool(key, value, source);
  } else if (key == "expandable_segments_reserve_by_class") {
    if (value.size() < 2 || value.front() != '[' || value.back() != ']') {
      fail("{}: expandable_segments_reserve_by_class '{}': expected [class:reserve,...]", source, value);
    }
  } else if (key != "expandable_segments_reserve") {
    return false;
  }
  return true;
}

// Settings PyTorch accepts that change where memory goes in a way headroom's model of the caching
// allocator does not reproduce. `modelled`: refuse them (the model would be wrong); otherwise check
// them as PyTorch does and accept them.
void apply_unmodelled(const std::string& key, const std::string& value, const std::string& source, bool modelled) {
  if (key == "backend") {
    if (value != "native" && value != "cudaMallocAsync") {
      fail("{}: backend '{}': accepted: native or cudaMallocAsync", source, value);
    }
    if (value == "cudaMallocAsync" && modelled) {
      fail("{}: backend:cudaMallocAsync is CUDA's own allocator, which headroom does not reproduce; accepted: "
           "backend:native",
           source);
    }
    return;
  }
  // large_segment_size_mb: the size of the segments large blocks are carved from (20 MiB by default).
  const int64_t mb = parse_count(key, value, source);
  if (mb == 0) fail("{}: large_segment_size_mb must be positive", source);
  if (modelled && mb != kLargeBufferMiB) {
    fail("{}: large_segment_size_mb:{}: headroom's model of the caching allocator keeps PyTorch's default of 20 MiB "
         "segments; accepted here: large_segment_size_mb:20 or none",
         source, mb);
  }
}

// One "key:value" option applied to `c`.
void apply_option(AllocatorConfig& c, const std::string& option, const std::string& source, bool modelled) {
  const auto colon = option.find(':');
  if (colon == std::string::npos) {
    fail("{}: option '{}' has no value; expected key:value, e.g. expandable_segments:True, with a key of: {}", source,
         option, kAcceptedKeys);
  }
  const std::string key = trim(option.substr(0, colon));
  const std::string value = trim(option.substr(colon + 1));
  if (key == "max_split_size_mb" || key == "max_non_split_rounding_mb") {
    const int64_t mb = parse_count(key, value, source);
    if (mb < kLargeBufferMiB) fail("{}: {} {} is too small; it must be at least 20", source, key, mb);
    if (mb > (int64_t{1} << 42)) fail("{}: {} {} is larger than any device", source, key, mb);
    (key == "max_split_size_mb" ? c.max_split_size : c.max_non_split_rounding_size) = mb * kMiB;
  } else if (key == "garbage_collection_threshold") {
    char* end = nullptr;
    const double t = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !(t > 0.0) || !(t < 1.0)) {
      fail("{}: garbage_collection_threshold '{}' must be a number between 0 and 1 (exclusive)", source, value);
    }
    c.garbage_collection_threshold = t;
  } else if (key == "roundup_power2_divisions") {
    if (!value.empty() && value.front() == '[') {
      if (value.back() != ']') fail("{}: roundup_power2_divisions '{}' has no closing ']'", source, value);
      parse_divisions_list(c, value, source);
    } else {
      const int64_t d = parse_divisions(value, source);
      if (d == 0) fail("{}: roundup_power2_divisions must be a power of 2; 0 is accepted only in the [...] form", source);
      c.roundup_power2_divisions.fill(d);
    }
  } else if (key == "expandable_segments") {
    c.expandable_segments = parse_bool(key, value, source);
  } else if (key == "backend" || key == "large_segment_size_mb") {
    apply_unmodelled(key, value, source, modelled);
  } else if (key == "release_lock_on_cudamalloc" || key == "pinned_use_cuda_host_register" ||
             key == "release_lock_on_hipmalloc" || key == "pinned_use_hip_host_register" ||  // ROCm's names
             key == "pinned_num_register_threads" || key == "pinned_use_background_threads" ||
             key == "pinned_reserve_segment_size_mb" || key == "graph_capture_record_stream_reuse" ||
             key == "per_process_memory_fraction") {
    c.ignored.push_back(option);
  } else if (apply_torch215_key(key, value, source)) {
    c.ignored.push_back(option);
  } else {
    fail("{}: unknown option '{}'; accepted: {}", source, key, kAcceptedKeys);
  }
}

AllocatorConfig parse_options(const std::string& text, const std::string& source, bool modelled) {
  AllocatorConfig c;
  if (trim(text).empty()) return c;
  for (const std::string& option : split_top(text, ',', source)) {
    if (!option.empty()) apply_option(c, option, source, modelled);
  }
  return c;
}

}  // namespace

AllocatorConfig parse_allocator_config(const std::string& text, const std::string& source) {
  return parse_options(text, source, true);
}

void check_allocator_config(const std::string& text, const std::string& source) { parse_options(text, source, false); }

std::string allocator_config_from_environment() {
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') return v;
  }
  return "";
}

}  // namespace headroom
