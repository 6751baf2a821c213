// The guard's rules (train/guard_policy.h) and the batch-size search (train/batch_search.h), for
// python/headroom/guard.py, which runs the user's step function under them.
#include <fmt/format.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "train/batch_search.h"
#include "train/guard_policy.h"
#include "util/json.h"

namespace py = pybind11;

namespace headroom::python {

void bind_guard(py::module_& m) {
  m.def(
      "after_step_oom",
      [](int64_t micro, bool updating, bool guard_on) {
        const GuardDecision d = after_step_oom(micro, updating, guard_on, std::nullopt);
        const char* action = d.action == GuardAction::halve   ? "halve"
                             : d.action == GuardAction::again ? "again"
                                                              : "give_up";
        return py::make_tuple(action, d.micro);
      },
      py::arg("micro"), py::arg("updating"), py::arg("guard_on"),
      "What the guard does after a step ran out of memory with `micro` rows per micro-batch: "
      "('halve', next micro) or ('give_up', micro).");
  m.def(
      "accumulation_for",
      [](int64_t rows, int64_t micro) {
        if (rows < 0 || micro < 1) {
          throw py::value_error(fmt::format("accumulation_for(rows={}, micro={}): accepted: rows 0 or more, micro 1 or more",
                                            rows, micro));
        }
        return accumulation_for(rows, micro);
      },
      py::arg("rows"), py::arg("micro"), "The micro-batches of `micro` rows that `rows` rows take.");
  m.def(
      "search_max_batch",
      [](const std::function<py::tuple(int64_t)>& trial, int64_t budget, int64_t limit,
         const std::optional<std::function<int64_t(int64_t)>>& predict) {
        const FitResult r = search_max_batch(
            [&](int64_t batch) {
              const py::tuple t = trial(batch);
              return Trial{batch, t[0].cast<bool>(), t[1].cast<int64_t>()};
            },
            budget, limit, predict ? PeakPredictor(*predict) : PeakPredictor{});
        return dump_json(r.to_json());
      },
      py::arg("trial"), py::arg("budget"), py::arg("limit"), py::arg("predict"),
      "search_max_batch with trial(batch) -> (fits, peak_bytes); the FitResult's JSON.");
}

}  // namespace headroom::python
