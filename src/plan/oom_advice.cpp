#include "plan/oom_advice.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <vector>

#include "config/model_config.h"
#include "estimate/estimator.h"
#include "plan/levers.h"
#include "util/size.h"

namespace headroom {
namespace {

std::string verdict(int64_t peak, int64_t budget) {
  return fmt::format("{} ({})", format_bytes(peak), peak <= budget ? "fits" : "does not fit");
}

// Each lever change of the table that lowers the predicted peak at micro-batch 1, then the best of
// each lever together (pure bf16 only alone: it changes the model's weights).
std::string estimated_levers(const RunConfig& cfg, int64_t budget) {
  const ModelConfig model = load_model_config(cfg.model, cfg.overrides);
  RunConfig one = cfg;
  one.batch = 1;
  one.accum = 1;
  auto peak_of = [&](const RunConfig& c) { return estimate(model, train_spec(c)).peak_bytes; };
  const int64_t own = peak_of(one);
  std::vector<std::string> parts;
  std::map<Lever, std::pair<int64_t, const LeverChange*>> best;
  const std::vector<LeverChange> changes = lever_changes(one, model);
  for (const LeverChange& ch : changes) {
    if (ch.lever == Lever::accumulation) continue;  // nothing to split at micro-batch 1
    RunConfig c = one;
    ch.apply(c);
    const int64_t peak = peak_of(c);
    if (peak >= own) continue;
    parts.push_back(fmt::format("{} {}", ch.flags, verdict(peak, budget)));
    if (ch.lever == Lever::precision && c.precision == Precision::bf16) continue;
    auto [it, fresh] = best.try_emplace(ch.lever, peak, &ch);
    if (!fresh && peak < it->second.first) it->second = {peak, &ch};
  }
  if (one.seq >= 32) {
    RunConfig c = one;
    c.seq /= 2;
    parts.push_back(fmt::format("--seq {} {}", c.seq, verdict(peak_of(c), budget)));
  }
  if (parts.empty()) return "";
  RunConfig all = one;
  for (const auto& [lever, choice] : best) choice.second->apply(all);
  return fmt::format("; by the estimator, at micro-batch 1 with {} of budget: {}; all but pure bf16 together {}",
                     format_bytes(budget), fmt::join(parts, ", "), verdict(peak_of(all), budget));
}

}  // namespace

std::string oom_advice(const OomReport& r, const RunConfig& cfg) {
  if (r.during_setup) return "";
  std::vector<std::string> levers;
  const Breakdown& b = r.breakdown;
  if (r.during_update) {
    levers.push_back(
        "it ran out during or after the optimizer update, which cannot be run again: a lighter "
        "optimizer leaves the update more room");
  }
  if (b.activations >= std::max({b.weights, b.gradients, b.optimizer})) {
    if (cfg.checkpointing != CheckpointPolicy::full()) {
      levers.push_back("--checkpointing full (recompute activations in backward)");
    }
    if (cfg.precision == Precision::fp32) levers.push_back("--precision bf16-mixed (half-size activations)");
    if (cfg.attention == AttentionPath::math) levers.push_back("--attention flash (no score matrix)");
    levers.push_back("a shorter --seq");
  }
  if (b.optimizer >= b.weights && cfg.optimizer != OptimizerKind::sgd) {
    levers.push_back("--optimizer adafactor or sgd (less optimizer state)");
  }
  if (cfg.precision != Precision::bf16) {
    levers.push_back("--precision bf16 (2 bytes per weight, gradient and state value)");
  }
  if (r.budget >= 0) levers.push_back("a larger --memory-budget");
  std::string out = r.guard_on ? "" : "the OOM guard is off (--no-guard); ";
  if (r.guard_on && r.micro_batch == 1) out += "micro-batch 1 does not fit either; ";
  out += fmt::format("levers that reduce this step's memory: {}", fmt::join(levers, "; "));
  if (r.budget > 0) out += estimated_levers(cfg, r.budget);
  return out;
}

}  // namespace headroom
