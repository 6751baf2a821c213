#include "memory/cache_policy.h"

#include <fmt/format.h>

#include "util/size.h"

namespace headroom {

CacheDecision after_oom(const CacheState& s) {
  CacheDecision d;
  if (s.expandable_segments) {
    d.reason = "expandable segments are already on";
    return d;
  }
  if (s.requested > 0 && s.inactive_split >= s.requested) {
    d.action = CacheAction::expandable_segments;
    d.reason = fmt::format("{} free inside fragmented segments could have held the {} request",
                           format_bytes(s.inactive_split), format_bytes(s.requested));
    return d;
  }
  if (s.requested > 0 && s.limit > 0 && s.allocated + s.requested <= s.limit) {
    d.action = CacheAction::expandable_segments;
    d.reason = fmt::format("{} allocated and the {} request fit the {} cap; the allocator's segments ({} reserved) did "
                           "not",
                           format_bytes(s.allocated), format_bytes(s.requested), format_bytes(s.limit),
                           format_bytes(s.reserved));
    return d;
  }
  d.reason = s.requested > 0 ? fmt::format("only {} free inside segments for a {} request",
                                           format_bytes(s.inactive_split), format_bytes(s.requested))
                             : "the request's size is unknown";
  return d;
}

bool empty_cache_after_reshape(int64_t allocated, int64_t reserved, double fraction) {
  return reserved > 0 && static_cast<double>(reserved - allocated) >= fraction * static_cast<double>(reserved);
}

}  // namespace headroom
