#include "train/oom_guard.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cstdio>

#include "memory/budget_allocator.h"
#include "memory/cache_policy.h"
#include "util/files.h"
#include "util/size.h"

namespace headroom {
namespace {

// Arms --inject-oom for the step it names; disarms when the step ends, however it ends.
class InjectionScope {
 public:
  InjectionScope(const std::optional<OomInjection>& injection, int64_t step)
      : armed_(injection && injection->step == step + 1) {
    if (!armed_) return;
    BudgetAllocator& a = BudgetAllocator::install();
    if (injection->nth > 0) {
      a.fail_nth_allocation(injection->nth);
    } else {
      a.fail_allocation_above(injection->above_bytes);
    }
  }
  ~InjectionScope() {
    if (armed_) BudgetAllocator::install().disarm();
  }
  InjectionScope(const InjectionScope&) = delete;
  InjectionScope& operator=(const InjectionScope&) = delete;

 private:
  bool armed_;
};

}  // namespace

OomGuard::OomGuard(Run& run) : run_(run), global_rows_(run.config.batch * run.config.accum), micro_(run.config.batch) {}

OomReport OomGuard::diagnose(const c10::OutOfMemoryError& e, const StepShape& shape, bool updating) {
  MemoryMonitor& monitor = *run_.monitor;
  const MemoryProbe& probe = *run_.probe;
  OomReport r;
  r.step = shape.step + 1;
  r.phase = monitor.last_phase();
  r.message = first_line(e.what_without_backtrace());
  r.budget = probe.budget().value_or(-1);
  r.live_before_step = monitor.step_start_live();
  r.micro_batch = shape.micro;
  r.during_update = updating;
  r.guard_on = !run_.config.no_guard;
  if (auto event = probe.last_oom()) {
    r.phase = event->phase;
    r.requested = event->requested;
    r.in_use = event->live;
    r.injected = event->injected;
    r.breakdown = monitor.breakdown_at(event->live, event->sequence);
  } else {
    r.in_use = probe.peak_bytes();
    r.breakdown = monitor.breakdown_at(r.in_use, std::nullopt);
  }
  // Release what the failed step held: its activations are gone with the unwound stack, its
  // gradients are not.
  zero_grad(run_.parameters());
  monitor.abort_step();
  r.live_after_cleanup = probe.live_bytes();
  return r;
}

GuardedStep OomGuard::run(int64_t step) {
  const InjectionScope injection(run_.config.inject_oom, step);
  const bool quiet = run_.config.quiet;
  GuardedStep g;
  for (;;) {
    const StepShape shape{step, global_rows_, micro_};
    run_.monitor->begin_step(step);
    try {
      run_step(run_, shape, g.outcome);
      g.micro = shape.micro;
      g.accum = shape.accum();
      return g;
    } catch (const c10::OutOfMemoryError& e) {
      // A caching allocator's state, before the failed step's gradients are released (its activations
      // went with the unwound stack: the cpu allocator's own record has the figures at the failure).
      std::optional<CacheState> cache;
      const auto event = run_.probe->last_oom();
      // An injected fault says nothing about the allocator's segments.
      if (const auto st = run_.probe->allocator_state(); st && !(event && event->injected)) {
        cache = CacheState{st->allocated, st->reserved, st->inactive_split,
                           event ? event->requested : requested_bytes_of(e.what_without_backtrace()),
                           st->expandable_segments, run_.probe->budget().value_or(-1)};
        if (event && event->caching) {
          cache->allocated = event->caching->allocated;
          cache->reserved = event->caching->reserved;
        }
      }
      const bool updating = g.outcome.update_started;
      OomReport report = diagnose(e, shape, updating);
      if (run_.config.no_guard || updating) {
        g.oom = report;
        return g;
      }
      if (cache) {
        const CacheDecision d = after_oom(*cache);
        if (d.action == CacheAction::expandable_segments) {
          // Fragmentation, not size: the same micro-batch again, in expandable segments.
          run_.probe->enable_expandable_segments();
          if (!quiet) {
            fmt::print(stderr,
                       "step {}: out of memory with micro-batch {}: {}; expandable segments on, same "
                       "micro-batch again\n",
                       step + 1, micro_, d.reason);
          }
          ++g.recoveries;
          continue;
        }
      }
      if (micro_ == 1) {
        g.oom = report;
        return g;
      }
      const int64_t smaller = (micro_ + 1) / 2;
      if (!quiet) {
        fmt::print(stderr,
                   "step {}: out of memory in {} with micro-batch {} ({} in use); running the step again "
                   "as {} x {}\n",
                   step + 1, phase_name(report.phase), micro_, format_bytes(report.in_use), smaller,
                   (global_rows_ + smaller - 1) / smaller);
      }
      micro_ = smaller;
      ++g.recoveries;
      // Segments cut for the old shapes: returned once if enough of the reservation is idle.
      if (const auto st = run_.probe->allocator_state(); st && empty_cache_after_reshape(st->allocated, st->reserved)) {
        run_.probe->empty_cache();
      }
    }
  }
}

}  // namespace headroom
