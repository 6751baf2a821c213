// headroom._core — the C++ core, for python/headroom (which is what users import).
#include "bindings.h"
#include "util/error.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "headroom's C++ core; use the `headroom` package, which wraps it.";
  // A user's mistake (a bad config, size or name) is a ValueError with headroom's one-line message.
  pybind11::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const headroom::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  headroom::python::bind_memory(m);
  headroom::python::bind_estimate(m);
  headroom::python::bind_guard(m);
  headroom::python::bind_snapshot(m);
  headroom::python::bind_trace(m);
  headroom::python::bind_optim(m);
}
