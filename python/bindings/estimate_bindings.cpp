// estimate and plan for any model config, and the plan as settings (plan/plan_settings.h), for
// python/headroom/predict.py. Settings arrive as the CLI's flags ({"precision": "bf16-mixed"}), so
// they are parsed, checked and named in errors exactly as `headroom estimate` and `plan` do.
#include <pybind11/stl.h>

#include <algorithm>
#include <map>

#include "bindings.h"
#include "config/model_config.h"
#include "config/run_config.h"
#include "estimate/estimator.h"
#include "plan/plan_settings.h"
#include "plan/planner.h"
#include "util/error.h"
#include "util/json.h"

namespace py = pybind11;

namespace headroom::python {
namespace {

// A RunConfig from flag names and their text, through the CLI's own field table.
RunConfig run_config(const std::map<std::string, std::string>& flags) {
  RunConfig c;
  for (const auto& [name, value] : flags) {
    const RunField* field = find_run_field(name);
    if (field == nullptr) fail("unknown setting '{}'", name);
    field->set(c, value);
  }
  validate(c);
  return c;
}

Plan plan_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  Plan p;
  p.batch = j.at("batch").get<int64_t>();
  p.accum = j.at("accum").get<int64_t>();
  p.precision = parse_precision(j.at("precision").get<std::string>());
  p.checkpointing = parse_checkpoint_policy(j.at("checkpointing").get<std::string>());
  p.optimizer = parse_optimizer(j.at("optimizer").get<std::string>());
  p.attention = parse_attention_path(j.at("attention").get<std::string>());
  p.shard = parse_shard_level(j.value("shard", std::string("none")));
  p.offload = parse_offload(j.value("offload", std::string("none")));
  p.pipeline.stages = j.value("pipeline", int64_t{1});
  p.tensor_parallel = j.value("tensor_parallel", int64_t{1});
  p.world = j.value("data_parallel", j.value("world_size", int64_t{1}) / (p.pipeline.stages * p.tensor_parallel));
  return p;
}

}  // namespace

void bind_estimate(py::module_& m) {
  m.def(
      "estimate",
      [](const std::string& config_json, const std::string& origin, const std::map<std::string, std::string>& flags) {
        const auto json = nlohmann::json::parse(config_json, nullptr, false);
        if (json.is_discarded() || !json.is_object()) fail("{}: not a JSON object", origin);
        const ModelConfig model = model_config_from_json(json, origin);
        TrainSpec spec = train_spec(run_config(flags));
        spec.dataset_bytes = 0;  // the user's data is not in headroom's memory
        return dump_json(estimate(model, spec).to_json());
      },
      py::arg("config_json"), py::arg("origin"), py::arg("flags"),
      "The estimate's JSON (as `headroom estimate --json`) for a config.json's text and CLI flags.");
  m.def(
      "plan",
      [](const std::map<std::string, std::string>& flags, int64_t global_batch, int64_t budget, double margin,
         bool allow_optimizer_change, const std::vector<std::string>& allow) {
        PlanRequest r;
        r.base = run_config(flags);
        r.global_batch = global_batch;
        r.budget = budget;
        r.margin = margin;
        r.allow_optimizer_change = allow_optimizer_change;
        for (const std::string& lever : allow) {
          if (lever == "optimizer") r.allow_optimizer_change = true;
          else if (lever == "adamw8bit") r.allow_adamw8bit = true;
          else if (lever == "offload") r.allow_offload = true;
          else fail("allow: '{}': accepted: optimizer, adamw8bit, offload", lever);
        }
        if (global_batch < 1) fail("global_batch {}: accepted: a positive number of sequences", global_batch);
        if (budget < 1) fail("budget {}: accepted: a positive size", budget);
        PlanResult result = plan_with_calibration(r, nullptr);
        nlohmann::json j = result.to_json();
        j["global_batch"] = global_batch;
        j["budget_bytes"] = budget;
        if (result.plans.empty())
          j["smallest_peak"] = {{"bytes", result.smallest_peak}, {"plan", result.smallest_peak_plan}};
        return dump_json(j);
      },
      py::arg("flags"), py::arg("global_batch"), py::arg("budget"), py::arg("margin"),
      py::arg("allow_optimizer_change"), py::arg("allow") = std::vector<std::string>{},
      "The plan's JSON (as `headroom plan --json --no-calibrate`: ranked by FLOPs).");
  m.def(
      "training_arguments", [](const std::string& plan) { return dump_json(training_arguments(plan_from_json(plan))); },
      py::arg("plan_json"));
  m.def(
      "training_arguments_code", [](const std::string& plan) { return training_arguments_code(plan_from_json(plan)); },
      py::arg("plan_json"));
  m.def(
      "lightning_trainer_kwargs",
      [](const std::string& plan) { return dump_json(lightning_trainer_kwargs(plan_from_json(plan))); },
      py::arg("plan_json"));
  m.def(
      "lightning_trainer_code", [](const std::string& plan) { return lightning_trainer_code(plan_from_json(plan)); },
      py::arg("plan_json"));
  m.def(
      "torch_loop_code",
      [](const std::string& plan, const std::string& device) { return torch_loop_code(plan_from_json(plan), device); },
      py::arg("plan_json"), py::arg("device"));
}

}  // namespace headroom::python
