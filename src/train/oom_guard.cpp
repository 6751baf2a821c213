#include "train/oom_guard.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cstdio>

#include "memory/budget_allocator.h"
#include "memory/cache_policy.h"
#include "train/guard_policy.h"
#include "train/step.h"
#include "util/error.h"
#include "util/files.h"
#include "util/size.h"

namespace headroom {
namespace {

// Arms --inject-oom for the step it names; disarms when the step ends, however it ends.
class InjectionScope {
 public:
  InjectionScope(const std::optional<OomInjection>& injection, int64_t step, int rank)
      : armed_(injection && injection->step == step + 1 && (injection->rank < 0 || injection->rank == rank)) {
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

OomGuard::OomGuard(Run& run) : run_(run), rows_(run.config.batch * run.config.accum), micro_(run.config.batch) {}

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
    r.breakdown = monitor.breakdown_at(event->live, event->sequence, event->tagged);
  } else {
    r.in_use = probe.peak_bytes();
    r.breakdown = monitor.breakdown_at(r.in_use, std::nullopt, probe.peak_tagged_bytes());
  }
  // Release what the failed step held: its activations are gone with the unwound stack, its
  // gradients are not.
  zero_grad(run_.parameters());
  if (run_.replicas) run_.replicas->zero_grad();
  monitor.abort_step();
  r.live_after_cleanup = probe.live_bytes();
  return r;
}

namespace {
// What every rank does after a failed attempt; data-parallel ranks agree on the largest, which
// carries the failed rank in its low bits (codes compare by action first).
using Action = GuardAction;
int encode(Action a, int rank) { return (static_cast<int>(a) << 16) | (rank + 1); }
Action action_of(int code) { return static_cast<Action>(code >> 16); }
int rank_of(int code) { return (code & 0xffff) - 1; }

// --shard full's rehearsal of the ranks' collectives, before the step: out of memory in it is
// nothing the guard can lower.
void rehearse_or_fail(Run& run, int64_t step) {
  try {
    rehearse_collectives(run, step);
  } catch (const c10::OutOfMemoryError& e) {
    fail(
        "rank {}: out of memory in a one-row micro-batch (--shard full's rehearsal of the ranks' collectives): {}; "
        "accepted: a shorter --seq, or more memory",
        run.rank(), first_line(e.what_without_backtrace()));
  }
}

// A caching allocator's state, before the failed step's gradients are released (its activations
// went with the unwound stack: the cpu allocator's own record has the figures at the failure).
std::optional<CacheState> cache_state_at_oom(MemoryProbe& probe, const c10::OutOfMemoryError& e) {
  std::optional<CacheState> cache;
  const auto event = probe.last_oom();
  // An injected fault says nothing about the allocator's segments.
  if (const auto st = probe.allocator_state(); st && !(event && event->injected)) {
    cache = CacheState{st->allocated, st->reserved, st->inactive_split,
                       event ? event->requested : requested_bytes_of(e.what_without_backtrace()),
                       st->expandable_segments, probe.budget().value_or(-1)};
    if (event && event->caching) {
      cache->allocated = event->caching->allocated;
      cache->reserved = event->caching->reserved;
    }
  }
  return cache;
}

// Another rank ran out of memory (`code`, agreed); this one's micro-batch went well but is part of
// a failed step, whose gradients it drops.
OomReport peer_failure_report(Run& run, int code, int64_t step, int64_t micro) {
  OomReport report;
  report.step = step + 1;
  report.phase = run.monitor->last_phase();
  report.micro_batch = micro;
  report.rank = rank_of(code);
  report.elsewhere = true;
  report.message = fmt::format("rank {} ran out of memory", report.rank);
  run.replicas->zero_grad();
  run.monitor->abort_step();
  report.live_after_cleanup = run.probe->live_bytes();
  return report;
}

// Fragmentation, not size: the same micro-batch again, in expandable segments.
void retry_in_expandable_segments(Run& run, bool quiet, int64_t step, int64_t micro, int code,
                                  const std::string& why) {
  if (run.probe->allocator_state()) run.probe->enable_expandable_segments();
  if (!quiet) {
    fmt::print(stderr, "step {}: out of memory with micro-batch {}{}: {}; expandable segments on, same micro-batch again\n",
               step + 1, micro, run.replicas ? fmt::format(" on rank {}", rank_of(code)) : "",
               why.empty() ? "fragmentation" : why);
  }
}

// The micro-batch the step runs again with (half of `micro`), announced.
int64_t halve_micro_batch(const Run& run, bool quiet, int64_t step, int64_t micro, int64_t rows, int code,
                          const OomReport& report) {
  const int64_t smaller = halved_micro(micro);
  if (!quiet) {
    const std::string where = run.replicas ? fmt::format("on rank {}", rank_of(code))
                                           : fmt::format("in {}", phase_name(report.phase));
    fmt::print(stderr, "step {}: out of memory {} with micro-batch {}{}; {} the step again as {} x {}\n", step + 1,
               where, micro, report.elsewhere ? "" : fmt::format(" ({} in use)", format_bytes(report.in_use)),
               run.replicas ? "every rank runs" : "running", smaller, accumulation_for(rows, smaller));
  }
  return smaller;
}

// Segments cut for the old shapes: returned once if enough of the reservation is idle.
void release_cache_after_reshape(MemoryProbe& probe) {
  if (const auto st = probe.allocator_state(); st && empty_cache_after_reshape(st->allocated, st->reserved)) {
    probe.empty_cache();
  }
}
}  // namespace

GuardedStep OomGuard::run(int64_t step) {
  rehearse_or_fail(run_, step);
  const InjectionScope injection(run_.config.inject_oom, step, run_.rank());
  const bool quiet = run_.config.quiet || run_.rank() != 0;
  DataParallel* replicas = run_.replicas.get();
  GuardedStep g;
  for (;;) {
    const StepShape shape{step, rows_, micro_, run_.data_rank(), run_.data_ranks()};
    run_.monitor->begin_step(step);
    OomReport report;
    int code = 0;
    std::string why;
    try {
      run_step(run_, shape, g.outcome);
      g.micro = shape.micro;
      g.accum = shape.accum();
      return g;
    } catch (const c10::OutOfMemoryError& e) {
      const std::optional<CacheState> cache = cache_state_at_oom(*run_.probe, e);
      // Past the ranks' last agreement (in the update) the others are inside collectives this rank
      // will not join: it cannot re-run the step, and they learn of it when it exits.
      const bool updating = g.outcome.update_started || g.outcome.agreed;
      report = diagnose(e, shape, updating);
      if (replicas || run_.model_parallel()) report.rank = run_.rank();
      if (run_.model_parallel()) {
        // The other stages (or shares) are part-way through the step's collectives: the step cannot be
        // run again together. This rank ends with the report; they stop when they lose contact with it.
        g.oom = report;
        return g;
      }
      const GuardDecision decision = after_step_oom(micro_, updating, !run_.config.no_guard, cache);
      why = decision.reason;
      code = encode(decision.action, run_.rank());
      if (replicas && !updating) {
        replicas->abandon_backward();  // the collectives the others' micro-batch still expects
        code = replicas->agree(code);
      }
    } catch (const PeerFailure& peer) {
      code = peer.code;
      report = peer_failure_report(run_, code, step, micro_);
    }
    // Every rank acts on the agreed outcome; a rank that failed itself keeps its own report.
    const Action action = action_of(code);
    if (action == Action::give_up) {
      g.oom = report;
      return g;
    }
    ++g.recoveries;
    if (action == Action::again) {
      retry_in_expandable_segments(run_, quiet, step, micro_, code, why);
      continue;
    }
    micro_ = halve_micro_batch(run_, quiet, step, micro_, rows_, code, report);
    release_cache_after_reshape(*run_.probe);
  }
}

}  // namespace headroom
