#include "plan/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "estimate/estimator.h"
#include "optim/optimizer.h"
#include "util/error.h"

namespace headroom {

nlohmann::json Plan::to_json() const {
  return {{"batch", batch},
          {"accum", accum},
          {"precision", precision},
          {"checkpointing", checkpointing},
          {"optimizer", optimizer},
          {"attention", attention},
          {"predicted_peak_bytes", predicted_peak_bytes},
          {"predicted_step_seconds", predicted_step_seconds},
          {"predicted_step_time_ratio", predicted_step_time_ratio}};
}

nlohmann::json PlanResult::to_json() const {
  nlohmann::json list = nlohmann::json::array();
  for (const Plan& p : plans) list.push_back(p.to_json());
  return {{"plans", list}, {"considered", considered}};
}

namespace {

std::vector<int64_t> micro_batches(int64_t global) {
  std::set<int64_t> out;
  for (int64_t d = 1; d * d <= global; ++d) {
    if (global % d == 0) {
      out.insert(d);
      out.insert(global / d);
    }
  }
  return {out.begin(), out.end()};
}

std::vector<std::string> checkpoint_policies(int64_t layers) {
  std::vector<std::string> out = {"none", "selective"};
  for (int64_t k : {4, 2}) {
    if (layers > k) out.push_back(fmt::format("every:{}", k));
  }
  out.push_back("full");
  return out;
}

}  // namespace

PlanResult fitting_plans(const PlanRequest& r) {
  if (r.global_batch < 1) fail("--global-batch must be positive, got {}", r.global_batch);
  if (r.budget <= 0) fail("the planner needs a memory budget (--memory-budget SIZE)");
  const ModelConfig model = load_model_config(r.base.model, r.base.overrides);
  const TrainSpec base_spec = train_spec(r.base);
  const std::vector<std::string> precisions = r.base.precision == "bf16"
                                                  ? std::vector<std::string>{"bf16"}
                                                  : std::vector<std::string>{"fp32", "bf16-mixed", "fp16-mixed"};
  std::vector<std::string> optimizers = {r.base.optimizer};
  if (r.allow_optimizer_change) {
    for (auto k : {OptimizerKind::adamw, OptimizerKind::adam, OptimizerKind::adafactor, OptimizerKind::momentum,
                   OptimizerKind::sgd, OptimizerKind::adagrad}) {
      if (optimizer_name(k) != r.base.optimizer) optimizers.push_back(optimizer_name(k));
    }
  }
  const double limit = static_cast<double>(r.budget) * (1.0 - r.margin);
  PlanResult out;
  out.smallest_peak = -1;
  for (int64_t micro : micro_batches(r.global_batch)) {
    for (const auto& precision : precisions) {
      for (const auto& checkpointing : checkpoint_policies(model.num_layers)) {
        for (const char* attention : {"flash", "math"}) {
          for (const auto& optimizer : optimizers) {
            TrainSpec spec = base_spec;
            spec.batch = micro;
            spec.accum = (r.global_batch + micro - 1) / micro;
            spec.precision = parse_precision(precision);
            spec.checkpointing = parse_checkpoint_policy(checkpointing);
            spec.attention = parse_attention_path(attention);
            spec.optimizer = parse_optimizer(optimizer);
            const int64_t peak = estimate(model, spec).peak_bytes;
            ++out.considered;
            Plan p{micro, spec.accum, precision, checkpointing, optimizer, attention, peak};
            if (out.smallest_peak < 0 || peak < out.smallest_peak) {
              out.smallest_peak = peak;
              out.smallest_peak_plan = fmt::format("micro-batch {}, {}, checkpointing {}, {} attention, {}", micro,
                                                   precision, checkpointing, attention, optimizer);
            }
            if (static_cast<double>(peak) <= limit) out.plans.push_back(p);
          }
        }
      }
    }
  }
  return out;
}

std::vector<Precision> precisions_of(const PlanResult& plans) {
  std::set<std::string> names;
  for (const Plan& p : plans.plans) names.insert(p.precision);
  std::vector<Precision> out;
  for (const auto& n : names) out.push_back(parse_precision(n));
  return out;
}

void rank_plans(PlanResult& plans, const PlanRequest& r, const CostModel& cost) {
  const ModelConfig model = load_model_config(r.base.model, r.base.overrides);
  for (Plan& p : plans.plans) {
    p.predicted_step_seconds =
        cost.step_seconds(model, p.batch, r.global_batch, r.base.seq, parse_precision(p.precision),
                          parse_checkpoint_policy(p.checkpointing), parse_attention_path(p.attention));
  }
  // Ties (an uncalibrated model sees only FLOPs; float sums differ in the last bits): fewer, larger
  // micro-batches, then the smaller peak.
  std::stable_sort(plans.plans.begin(), plans.plans.end(), [](const Plan& a, const Plan& b) {
    const double scale = std::max(a.predicted_step_seconds, b.predicted_step_seconds);
    if (std::abs(a.predicted_step_seconds - b.predicted_step_seconds) > 1e-9 * scale) {
      return a.predicted_step_seconds < b.predicted_step_seconds;
    }
    if (a.accum != b.accum) return a.accum < b.accum;
    return a.predicted_peak_bytes < b.predicted_peak_bytes;
  });
  if (plans.plans.empty()) return;
  const double best = plans.plans.front().predicted_step_seconds;
  for (Plan& p : plans.plans) p.predicted_step_time_ratio = best > 0 ? p.predicted_step_seconds / best : 1.0;
}

RunConfig with_plan(RunConfig c, const Plan& p) {
  c.batch = p.batch;
  c.accum = p.accum;
  c.precision = p.precision;
  c.checkpointing = p.checkpointing;
  c.optimizer = p.optimizer;
  c.attention = p.attention;
  c.plan.clear();
  return c;
}

}  // namespace headroom
