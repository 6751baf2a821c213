// The Python module's parts, each binding one area of headroom_core (module.cpp assembles them).
// Results cross as JSON text, parsed on the Python side, so that Python sees the same objects as
// the CLI's --json output.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace headroom::python {

void bind_memory(pybind11::module_& m);    // the cpu allocator, budget, Monitor, leak verdict
void bind_estimate(pybind11::module_& m);  // estimate, plan, the plan as settings
void bind_guard(pybind11::module_& m);     // the guard's rules, the batch-size search
void bind_snapshot(pybind11::module_& m);  // analyze_snapshot: a PyTorch memory snapshot diagnosed
void bind_trace(pybind11::module_& m);     // the estimate of a recorded trace (any model)
void bind_optim(pybind11::module_& m);     // headroom's optimizers and the 8-bit map, for comparisons

}  // namespace headroom::python
