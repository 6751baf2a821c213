// The planner's bound-first search (fastest_fitting_plans, plan/planner.h): candidates taken in the
// order of a bound on their step time, each settled by its micro-batch family's estimates and its
// lighter families' (full checkpointing, flash attention, bf16-mixed), until none left could beat
// the fastest found; those are then estimated exactly. A pipeline layout is two candidates: cut
// evenly (its bound its time, settled by its family as one process is) and cut by memory (needed
// only where the even cut does not fit, and then its own estimate: its time is its cut's).
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include "plan/candidates.h"
#include "plan/planner.h"

namespace headroom {

namespace {

constexpr size_t kNone = SIZE_MAX;

// A family: the candidates that differ only in the micro-batch (and so the accumulation), with as
// many micro-batches in flight. A step's peak grows with its micro-batch, so one that does not fit
// settles every larger one, and one that fits every smaller one. Some settings keep less than
// others whatever the rest: full checkpointing (each layer's input, and one layer's activations at
// a time) than any other policy, flash attention than math (which keeps each head's probabilities),
// bf16-mixed than fp16-mixed (the same step without the loss scaler's flags); not flash attention
// under per-op checkpointing, which keeps its output and log-sum-exp (0.1% above math's in
// planner_test's grid). A micro-batch that does not fit with the lighter setting, by a margin
// (others_margin), fits with no heavier one of the same layout: the family's `lighter` ones settle
// it.
struct MicroBatchFamily {
  int64_t fits_up_to = 0;
  int64_t fails_from = INT64_MAX;
  int64_t others_fail_from = INT64_MAX;  // the micro-batches too large for its heavier families
  std::vector<size_t> members;           // by micro-batch, ascending
  std::vector<size_t> lighter;           // the lightest first: every setting lighter at once, then each
};

// How far above the limit a lighter family must peak to settle the heavier ones. Recomputing a
// layer costs its activations again in backward; on a pipeline stage of few layers and few
// micro-batches that can outweigh what checkpointing saves (up to 12% in planner_test's grid), and
// each micro-batch's stages are cut apart, so a pipeline's are settled only well above it. One
// process holds every layer: none.
double others_margin(const TrainSpec& spec) { return spec.pipeline.stages > 1 ? 1.25 : 1.0; }

// The specs lighter than `spec` by one setting, and by all of them at once (first).
std::vector<TrainSpec> lighter_specs(const TrainSpec& spec) {
  std::vector<TrainSpec> one;
  TrainSpec all = spec;
  if (!(spec.checkpointing == CheckpointPolicy::full())) {
    one.push_back(spec);
    one.back().checkpointing = all.checkpointing = CheckpointPolicy::full();
  }
  if (spec.attention == AttentionPath::math && !spec.checkpointing.per_op()) {
    one.push_back(spec);
    one.back().attention = all.attention = AttentionPath::flash;
  }
  if (spec.precision == Precision::fp16_mixed) {
    one.push_back(spec);
    one.back().precision = all.precision = Precision::bf16_mixed;
  }
  if (one.size() > 1) one.insert(one.begin(), all);
  return one;
}

// What candidates_of varies, but the micro-batch.
std::string family_key(const TrainSpec& spec) {
  // As many micro-batches in flight: one, two (the second sees the first's gradients), or on a
  // pipeline's stage s min(accum, P - s), the step replaying min(accum, P - s + 1).
  const int64_t in_flight = std::min(spec.accum, spec.pipeline.stages + 1);
  return fmt::format("{} {} {} {} {} {} {} {} {} {} {} {}", in_flight, precision_name(spec.precision),
                     spec.checkpointing.name(), attention_path_name(spec.attention), optimizer_name(spec.optimizer),
                     offload_name(spec.offload), spec.loss.name(), shard_level_name(spec.shard), spec.world,
                     spec.pipeline.stages, pipeline_split_text(spec.pipeline.split), spec.tensor_parallel);
}

// Whether a candidate's bound is its step time: nothing its estimate tells (the pipeline's cut by
// memory, the offloaded bytes, the trainable parameters an 8-bit or offloaded update costs) enters its
// cost. A pipeline cut evenly (even_cut) is paced by ceil(layers / P) layers, as the bound assumes.
bool bound_is_exact(const TrainSpec& spec) {
  const bool cut_known = spec.pipeline.stages == 1 || !spec.pipeline.split.empty();
  return cut_known && spec.offload == Offload::none && spec.optimizer != OptimizerKind::adamw8bit;
}

struct Found {
  Plan plan;
  size_t index = 0;        // the candidate's, for ties
  bool estimated = false;  // else known to fit by its family, its peak not yet estimated
};

bool faster(const Found& a, const Found& b) {
  if (a.plan.predicted_step_seconds != b.plan.predicted_step_seconds) {
    return a.plan.predicted_step_seconds < b.plan.predicted_step_seconds;
  }
  if (a.plan.accum != b.plan.accum) return a.plan.accum < b.plan.accum;
  return a.index < b.index;
}

// The bound-first search of fastest_fitting_plans (planner.h; docs/estimate-and-plan.md).
class BoundFirstSearch {
 public:
  BoundFirstSearch(const PlanRequest& r, const CostModel& cost)
      : r_(r),
        s_(search_of(r)),
        cost_(cost),
        candidates_(candidates_of(r, s_.model, s_.base)),
        even_(even_siblings(candidates_)),
        want_(static_cast<size_t>(std::max<int64_t>(r.best_only, 1))) {
    const size_t n = candidates_.size();
    out_.smallest_peak = -1;
    out_.considered = static_cast<int64_t>(n);
    bound_.resize(n);
    order_.resize(n);
    family_.resize(n);
    estimated_.assign(n, 0);
    listed_.assign(n, 0);
    deferred_.assign(n, 0);
    undominated_.assign(n, 0);
    position_.resize(n);
    std::map<std::string, size_t> by_key;
    for (size_t i = 0; i < n; ++i) {
      // Its step time before its estimate: no offloaded bytes, no state to update, the pipeline's
      // stages as even as the layers allow. The estimate can only add to it.
      Plan p = plan_of_spec(candidates_[i]);
      cost_step(p, r_, s_.model, cost_, s_.base.cuda, /*bound=*/true);
      bound_[i] = p.predicted_step_seconds;
      order_[i] = i;
      family_[i] = by_key.emplace(family_key(candidates_[i]), by_key.size()).first->second;
    }
    // A pipeline's even cut comes before its cut by memory (the same bound; it settles the other).
    std::stable_sort(order_.begin(), order_.end(), [&](size_t a, size_t b) { return bound_[a] < bound_[b]; });
    for (size_t k = 0; k < n; ++k) position_[order_[k]] = k;
    families_.resize(by_key.size());
    for (size_t i = 0; i < n; ++i) families_[family_[i]].members.push_back(i);
    for (size_t i = 0; i < n; ++i) {
      MicroBatchFamily& f = families_[family_[i]];
      if (f.members.front() != i) continue;  // once a family
      for (const TrainSpec& spec : lighter_specs(candidates_[i])) {
        const auto lighter = by_key.find(family_key(spec));
        if (lighter != by_key.end()) f.lighter.push_back(lighter->second);
      }
    }
    for (MicroBatchFamily& f : families_) {
      std::sort(f.members.begin(), f.members.end(),
                [&](size_t a, size_t b) { return candidates_[a].batch < candidates_[b].batch; });
    }
  }

  PlanResult run() {
    for (;;) {
      settle_front();
      if ((at_ < candidates_.size() && bound_[order_[at_]] <= kth()) || !open_deferred().empty()) {
        probe();
      } else if (verified()) {
        break;
      }
    }
    // In the candidates' order, so that plans rank_plans finds equal keep the exhaustive order.
    std::sort(found_.begin(), found_.end(), [](const Found& a, const Found& b) { return a.index < b.index; });
    for (const Found& f : found_) out_.plans.push_back(f.plan);
    return out_;
  }

 private:
  // The step time of the want-th fastest found (infinite while fewer are).
  double kth() {
    if (found_.size() < want_) return std::numeric_limits<double>::infinity();
    std::nth_element(found_.begin(), found_.begin() + static_cast<std::ptrdiff_t>(want_ - 1), found_.end(), faster);
    return found_[want_ - 1].plan.predicted_step_seconds;
  }

  // The smallest micro-batch known not to fit in candidate i's family, by its own estimates or its
  // lighter family's.
  int64_t fails_from(size_t i) const { return fails_from(families_[family_[i]]); }
  int64_t fails_from(const MicroBatchFamily& f) const {
    int64_t out = f.fails_from;
    for (size_t l : f.lighter) out = std::min(out, families_[l].others_fail_from);
    return out;
  }

  // Whether candidate i fits by its family (its micro-batch no larger than one that did).
  bool fits_by_family(size_t i) const { return candidates_[i].batch <= families_[family_[i]].fits_up_to; }

  // A pipeline cut by memory whose even cut fits: never faster, never listed.
  bool dominated(size_t i) const { return even_[i] != kNone && !undominated_[i] && fits_by_family(even_[i]); }

  bool settled(size_t i) const {
    return candidates_[i].batch >= fails_from(i) || estimated_[i] || dominated(i) ||
           (fits_by_family(i) && bound_is_exact(candidates_[i]));
  }

  // Past the candidates at the front of the bound's order that their families settle, the fitting
  // ones found, while any could be faster than the want-th fastest found.
  void settle_front() {
    for (double limit = kth(); at_ < candidates_.size() && bound_[order_[at_]] <= limit; ++at_) {
      const size_t i = order_[at_];
      if (!settled(i)) {
        if (!deferrable(i)) return;
        if (!deferred_[i]) pending_.push_back(i);
        deferred_[i] = 1;
        continue;
      }
      if (listed_[i] || estimated_[i] || candidates_[i].batch >= fails_from(i) || dominated(i)) continue;
      Plan p = plan_of_spec(candidates_[i]);
      cost_step(p, r_, s_.model, cost_, s_.base.cuda, /*bound=*/false);
      found_.push_back({p, i, false});
      listed_[i] = 1;
      limit = kth();
    }
  }

  // A pipeline cut by memory whose even cut does not fit needs its own estimate (its time is its
  // cut's), and most such are slower than the plans the others settle: it waits until none of
  // those is left within the bar, which has fallen by then.
  bool deferrable(size_t i) const { return even_[i] != kNone; }

  // The deferred candidates still unsettled within the bar, in the bound's order.
  std::vector<size_t> open_deferred() {
    const double limit = kth();
    std::vector<size_t> out;
    for (size_t i : pending_) {
      if (bound_[i] <= limit && !settled(i)) out.push_back(i);
    }
    return out;
  }

  // What settles candidate i: its own estimate where its family knows it fits but its bound is not
  // its time; else, while a lighter family does not know whether its micro-batch fits, that
  // family's probe (one estimate can settle many heavier families); else its family's.
  size_t probe_for(size_t i, double limit) const {
    // A pipeline cut by memory: its even cut first (where that fits, this one is not needed).
    if (even_[i] != kNone && !undominated_[i] && !settled(even_[i])) return probe_for(even_[i], limit);
    const MicroBatchFamily& f = families_[family_[i]];
    if (candidates_[i].batch <= f.fits_up_to) return i;
    for (size_t k : f.lighter) {
      const MicroBatchFamily& l = families_[k];
      const size_t probe = probe_of(l, std::numeric_limits<double>::infinity());
      if (candidates_[i].batch > l.fits_up_to && candidates_[i].batch < l.fails_from && probe != kNone) return probe;
    }
    return probe_of(f, limit);
  }

  // A family's smallest micro-batch while nothing is known of it (one estimate settles a family none
  // of whose micro-batches fit), then the middle of those still unknown; kNone when none is.
  size_t probe_of(const MicroBatchFamily& f, double limit) const {
    const int64_t fails = fails_from(f);
    std::vector<size_t> open;
    for (size_t m : f.members) {
      if (candidates_[m].batch > f.fits_up_to && candidates_[m].batch < fails && bound_[m] <= limit) open.push_back(m);
    }
    if (open.empty()) return kNone;
    return f.fits_up_to == 0 ? open.front() : open[(open.size() - 1) / 2];
  }

  // The probes that settle the next unsettled candidates, a family at most once, estimated side by side.
  void probe() {
    const size_t chunk = static_cast<size_t>(std::max(4 * std::clamp(r_.threads, 1, 256), 8));
    const double limit = kth();
    std::vector<size_t> probes;
    std::set<size_t> probed;
    auto take = [&](size_t i) {
      const size_t probe = probe_for(i, limit);
      if (probed.insert(family_[probe]).second) probes.push_back(probe);
    };
    for (size_t k = at_; k < candidates_.size() && probes.size() < chunk && bound_[order_[k]] <= limit; ++k) {
      const size_t i = order_[k];
      if (!settled(i) && !deferrable(i)) take(i);
    }
    if (probes.empty()) {
      for (size_t i : open_deferred()) {
        if (probes.size() == chunk) break;
        take(i);
      }
    }
    const std::vector<Estimate> estimates = estimated(probes);
    for (size_t k = 0; k < probes.size(); ++k) {
      Plan p = plan_of_spec(candidates_[probes[k]]);
      const bool fits = estimated_plan(p, estimates[k], s_.limit);
      note_peak(out_, p);
      MicroBatchFamily& f = families_[family_[probes[k]]];
      if (!fits) {
        f.fails_from = std::min(f.fails_from, p.batch);
        if (static_cast<double>(p.predicted_peak_bytes) > s_.limit * others_margin(candidates_[probes[k]])) {
          f.others_fail_from = std::min(f.others_fail_from, p.batch);
        }
        continue;
      }
      f.fits_up_to = std::max(f.fits_up_to, p.batch);
      cost_step(p, r_, s_.model, cost_, s_.base.cuda, /*bound=*/false);
      if (listed_[probes[k]]) continue;  // a candidate is listed once
      found_.push_back({p, probes[k], true});
      listed_[probes[k]] = 1;
    }
  }

  // None left could be faster: the fastest want (and any tied with the last of them) must be
  // estimated, as every plan shown is. Whether they all were; one its family wrongly settled is
  // dropped (and the search goes on).
  bool verified() {
    // A pipeline cut by memory, estimated before its even cut was known to fit, leaves the list.
    if (std::erase_if(found_, [&](const Found& f) { return dominated(f.index); }) > 0) return false;
    std::sort(found_.begin(), found_.end(), faster);
    size_t keep = std::min(want_, found_.size());
    while (keep < found_.size() &&
           found_[keep].plan.predicted_step_seconds == found_[keep - 1].plan.predicted_step_seconds) {
      ++keep;
    }
    std::vector<size_t> which;
    for (size_t k = 0; k < keep; ++k) {
      if (!found_[k].estimated) which.push_back(found_[k].index);
    }
    if (which.empty()) {
      found_.resize(keep);
      return true;
    }
    const std::vector<Estimate> estimates = estimated(which);
    std::vector<Found> kept;
    for (Found& f : found_) {
      const auto k = std::find(which.begin(), which.end(), f.index);
      if (k != which.end()) {
        f.estimated = true;
        const bool fits = estimated_plan(f.plan, estimates[static_cast<size_t>(k - which.begin())], s_.limit);
        note_peak(out_, f.plan);
        if (!fits) {
          // An even cut its family wrongly judged to fit: its cut by memory is wanted after all, and
          // the search goes back to it.
          if (const size_t balanced = balanced_of(f.index); balanced != kNone) {
            undominated_[balanced] = 1;
            at_ = std::min(at_, position_[balanced]);
          }
          continue;
        }
        cost_step(f.plan, r_, s_.model, cost_, s_.base.cuda, /*bound=*/false);
      }
      kept.push_back(f);
    }
    found_ = std::move(kept);
    return false;
  }

  // The pipeline cut by memory whose even cut is candidate i, or kNone.
  size_t balanced_of(size_t i) const {
    return i + 1 < even_.size() && even_[i + 1] == i ? i + 1 : kNone;
  }

  std::vector<Estimate> estimated(const std::vector<size_t>& which) {
    std::vector<TrainSpec> specs;
    for (size_t i : which) {
      specs.push_back(candidates_[i]);
      estimated_[i] = 1;
    }
    out_.estimated += static_cast<int64_t>(specs.size());
    return estimate_all(s_.model, specs, r_.threads);
  }

  const PlanRequest& r_;
  const Search s_;
  const CostModel& cost_;
  const std::vector<TrainSpec> candidates_;
  const std::vector<size_t> even_;  // even_siblings(candidates_)
  const size_t want_;
  std::vector<double> bound_;
  std::vector<size_t> order_, family_;
  std::vector<char> estimated_;
  std::vector<char> listed_;       // in found_ (or once was)
  std::vector<char> undominated_;  // cut by memory, its even cut found not to fit after all
  std::vector<size_t> position_;   // each candidate's place in order_
  std::vector<char> deferred_;     // in pending_
  std::vector<size_t> pending_;    // deferrable ones passed, in the bound's order
  std::vector<MicroBatchFamily> families_;
  std::vector<Found> found_;
  size_t at_ = 0;
  PlanResult out_;
};

}  // namespace

PlanResult fastest_fitting_plans(const PlanRequest& r, const CostModel& cost) {
  return BoundFirstSearch(r, cost).run();
}

}  // namespace headroom
