// The estimate of a recorded allocation trace (estimate/trace_estimate.h), for
// python/headroom/anymodel.py: the user's own model, traced on fake tensors in Python, judged by the
// same C++ core as every other estimate.
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "estimate/trace_estimate.h"
#include "memory/allocator_config.h"
#include "util/error.h"
#include "util/json.h"

namespace py = pybind11;

namespace headroom::python {
namespace {

sim::Category category_named(const std::string& name) {
  for (int i = 0; i < sim::kCategories; ++i) {
    const auto c = static_cast<sim::Category>(i);
    if (name == sim::category_name(c)) return c;
  }
  fail("trace: category '{}' is not one of the estimate's", name);
}

Phase phase_named(const std::string& name) {
  if (name == "idle") return Phase::idle;
  for (Phase p : kStepPhases) {
    if (phase_name(p) == name) return p;
  }
  fail("trace: phase '{}': accepted: idle, data, forward, backward, optimizer, zero_grad", name);
}

}  // namespace

void bind_trace(py::module_& m) {
  m.def(
      "estimate_trace",
      [](const std::string& model, int64_t params, const std::vector<std::tuple<std::string, std::string, std::string>>& labels,
         const std::vector<std::tuple<int64_t, int64_t, bool, int, int>>& events, const std::vector<std::string>& phases,
         size_t step_begin, bool cuda, const std::string& allocator_conf) {
        TracedStep step;
        step.model = model;
        step.params = params;
        for (const auto& [name, category, formula] : labels) step.labels.push_back({name, category_named(category), formula});
        std::vector<Phase> phase_of;
        for (const std::string& p : phases) phase_of.push_back(phase_named(p));
        step.events.reserve(events.size());
        for (const auto& [storage, bytes, allocated, phase, label] : events) {
          if (phase < 0 || static_cast<size_t>(phase) >= phase_of.size()) fail("trace: phase index {}", phase);
          step.events.push_back({storage, bytes, allocated, phase_of[static_cast<size_t>(phase)], label});
        }
        step.step_begin = step_begin;
        step.cuda = cuda;
        step.caching = parse_allocator_config(allocator_conf, "allocator settings");
        return dump_json(estimate_traced(step).to_json());
      },
      py::arg("model"), py::arg("params"), py::arg("labels"), py::arg("events"), py::arg("phases"),
      py::arg("step_begin"), py::arg("cuda"), py::arg("allocator_conf"),
      "The estimate's JSON for a recorded trace: labels (name, category, formula); events (storage, bytes, "
      "allocated, phase index, label index); phases (names by index).");
}

}  // namespace headroom::python
