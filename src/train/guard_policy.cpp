#include "train/guard_policy.h"

namespace headroom {

GuardDecision after_step_oom(int64_t micro, bool updating, bool guard_on, const std::optional<CacheState>& cache) {
  GuardDecision d;
  d.micro = micro;
  if (!guard_on || updating || (micro <= 1 && !cache)) return d;
  if (cache) {
    const CacheDecision c = after_oom(*cache);
    if (c.action == CacheAction::expandable_segments) {
      d.action = GuardAction::again;
      d.reason = c.reason;
      return d;
    }
    if (micro <= 1) return d;
  }
  d.action = GuardAction::halve;
  d.micro = halved_micro(micro);
  return d;
}

}  // namespace headroom
