#include "python_origin.h"

#include <Python.h>
#include <frameobject.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>

#include "memory/budget_allocator.h"

namespace headroom::python {
namespace {

struct Origins {
  std::mutex mutex;
  std::shared_ptr<const std::vector<std::string>> skipped = std::make_shared<std::vector<std::string>>();
  std::unordered_map<std::string, uint32_t> ids;
  std::vector<std::string> names{""};  // id 0: none
  int holders = 0;
};

Origins& origins() {
  static auto* o = new Origins;  // never destroyed: allocations may ask during interpreter exit
  return *o;
}

bool skipped(const std::vector<std::string>& prefixes, std::string_view file) {
  return std::any_of(prefixes.begin(), prefixes.end(), [&](const std::string& p) { return file.starts_with(p); });
}

// The innermost frame of the calling thread outside the skipped packages, as text; "" if none.
std::string user_frame(const std::vector<std::string>& prefixes) {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  if (frame == nullptr) return {};
  Py_INCREF(frame);
  std::string out;
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    if (file != nullptr && !skipped(prefixes, file)) {
      const char* name = PyUnicode_AsUTF8(code->co_name);
      out = std::string(file) + ":" + std::to_string(PyFrame_GetLineNumber(frame)) + " in " + (name ? name : "?");
      Py_DECREF(code);
      Py_DECREF(frame);
      break;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference or null
    Py_DECREF(frame);
    frame = back;
  }
  if (PyErr_Occurred())
    PyErr_Clear();  // a file name that would not encode: no origin (the caller's error is kept apart)
  return out;
}

uint32_t current_origin() {
  // Only threads that have run Python: a native worker must not wait for the GIL its caller holds.
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing();
#else
  const bool finalizing = _Py_IsFinalizing();
#endif
  if (PyGILState_GetThisThreadState() == nullptr || !Py_IsInitialized() || finalizing) return 0;
  Origins& o = origins();
  std::shared_ptr<const std::vector<std::string>> prefixes;
  {
    std::lock_guard<std::mutex> lock(o.mutex);
    prefixes = o.skipped;
  }
  std::string where;
  {
    const PyGILState_STATE gil = PyGILState_Ensure();
    // The allocation may come from code with a Python error pending, and the walk may make frame
    // objects: keep that error, and keep the collector (and finalizers) out of the allocation.
    PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
    PyErr_Fetch(&type, &value, &traceback);
    const int collecting = PyGC_Disable();
    where = user_frame(*prefixes);
    if (collecting) PyGC_Enable();
    PyErr_Restore(type, value, traceback);
    PyGILState_Release(gil);
  }
  if (where.empty()) return 0;
  std::lock_guard<std::mutex> lock(o.mutex);
  auto [it, added] = o.ids.try_emplace(std::move(where), static_cast<uint32_t>(o.names.size()));
  if (added) o.names.push_back(it->first);
  return it->second;
}

}  // namespace

void set_skipped_prefixes(std::vector<std::string> prefixes) {
  Origins& o = origins();
  std::lock_guard<std::mutex> lock(o.mutex);
  o.skipped = std::make_shared<const std::vector<std::string>>(std::move(prefixes));
}

void enable_origins(bool on) {
  Origins& o = origins();
  std::lock_guard<std::mutex> lock(o.mutex);
  o.holders += on ? 1 : -1;
  BudgetAllocator::install().set_origin_source(o.holders > 0 ? &current_origin : nullptr);
}

std::string origin_name(uint32_t id) {
  Origins& o = origins();
  std::lock_guard<std::mutex> lock(o.mutex);
  return id < o.names.size() ? o.names[id] : std::string();
}

}  // namespace headroom::python
