// The cpu budget allocator, the Monitor and the leak verdict, for python/headroom/monitor.py and
// budget.py.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <optional>

#include "bindings.h"
#include "device/device.h"
#include "memory/budget_allocator.h"
#include "memory/leak_detector.h"
#include "memory/memory_monitor.h"
#include "memory/memory_probe.h"
#include "python_origin.h"
#include "train/step_record.h"
#include "util/error.h"
#include "util/json.h"
#include "util/size.h"

namespace py = pybind11;

namespace headroom::python {
namespace {

Phase phase_named(const std::string& name) {
  for (Phase p : kStepPhases) {
    if (phase_name(p) == name) return p;
  }
  fail("phase '{}': accepted: data, forward, backward, optimizer, zero_grad", name);
}

// One training loop's memory, step by step: MemoryMonitor over the device's probe, told the
// model's parameters (weights, and their .grad as gradients) and a function listing the
// optimizer's state tensors. A step runs from the previous end_step (or construction) to the next.
class Monitor {
 public:
  Monitor(const std::string& device, std::vector<at::Tensor> parameters, py::object optimizer_state, bool python_frames)
      : device_(resolve_device(device)),
        probe_(make_memory_probe(device_)),
        parameters_(std::move(parameters)),
        optimizer_state_(std::move(optimizer_state)),
        origins_(python_frames && device_.is_cpu()) {
    monitor_ = std::make_unique<MemoryMonitor>(
        *probe_, TrackedTensors{[this] { return parameters_; },
                                [this] {
                                  std::vector<at::Tensor> grads;
                                  for (const at::Tensor& p : parameters_) {
                                    if (p.grad().defined()) grads.push_back(p.grad());
                                  }
                                  return grads;
                                },
                                [this] {
                                  if (optimizer_state_.is_none()) return std::vector<at::Tensor>{};
                                  return optimizer_state_().cast<std::vector<at::Tensor>>();
                                }});
    begin(0);  // may throw (the optimizer's state callback): nothing is switched on before it
    if (device_.is_cuda()) probe_->record_origins(true);
    if (origins_) enable_origins(true);
  }
  ~Monitor() {
    scope_.reset();
    probe_->set_context(-1, Phase::idle);  // later allocations belong to no step of this loop
    if (origins_) enable_origins(false);
    if (device_.is_cuda()) probe_->record_origins(false);
  }
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  void enter(const std::string& name) {
    const Phase p = phase_named(name);
    if (scope_) fail("phase '{}' entered inside phase '{}': phases do not nest", name, phase_name(current_));
    current_ = p;
    step_peak_ = std::max(step_peak_, probe_->peak_bytes());  // the phase resets the probe's peak
    scope_.emplace(monitor_->phase(p));
  }
  void exit() {
    scope_.reset();
    probe_->set_context(step_, Phase::idle);
  }

  // Closes the step: its record as the --metrics line's JSON.
  std::string end_step(std::optional<double> loss, std::optional<int64_t> tokens, int64_t batch, int64_t accum,
                       int64_t oom_recoveries, std::optional<double> lr, std::optional<double> grad_norm) {
    if (scope_) fail("end_step() inside phase '{}': close the phase first", phase_name(current_));
    StepRecord r;
    r.memory = monitor_->end_step();
    r.step = step_ + 1;
    r.loss = loss.value_or(0);
    r.tokens = tokens.value_or(0);
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    r.peak_bytes = std::max({r.memory.peak, step_peak_, probe_->peak_bytes()});
    r.live_bytes = probe_->live_bytes();
    r.reserved_bytes = r.memory.reserved;
    r.peak_reserved_bytes = r.memory.peak_reserved;
    r.peak_inactive_split_bytes = r.memory.peak_inactive_split;
    r.batch = batch;
    r.accum = accum;
    r.oom_recoveries = oom_recoveries;
    r.lr = lr.value_or(0);
    r.grad_norm = grad_norm.value_or(0);
    series_.push_back({r.step, r.live_bytes, r.peak_bytes - start_live_});
    nlohmann::json j = r.to_json();
    // What the loop did not say is left out rather than written as zero.
    if (!loss) j.erase("loss");
    if (!tokens) j.erase("tokens");
    if (!lr) j.erase("lr");
    if (!grad_norm) j.erase("grad_norm");
    begin(step_ + 1);
    return dump_json(j);
  }

  // The step in flight failed (an OOM the guard absorbed): its figures are dropped, the step restarts.
  void abort_step() {
    scope_.reset();
    monitor_->abort_step();
    begin(step_);
  }

  std::string leak(int64_t warmup_steps) const {
    LeakOptions options;
    options.warmup_steps = warmup_steps;
    LeakVerdict v = judge_growth(series_, options);
    if (v.detected && (device_.is_cpu() || device_.is_cuda())) {
      v.sites = leak_sites(probe_->live_allocations(), warmup_steps, step_, origins_ ? origin_name : OriginName{});
    }
    return dump_json(v.to_json());
  }

  std::string summary() const { return monitor_->summary_table(); }
  int64_t live_bytes() const { return probe_->live_bytes(); }
  int64_t steps() const { return step_; }
  std::string source() const { return probe_->source(); }

 private:
  void begin(int64_t step) {
    step_ = step;
    monitor_->begin_step(step);
    probe_->reset_peak();
    probe_->set_context(step, Phase::idle);
    start_live_ = probe_->live_bytes();
    step_peak_ = start_live_;
    start_ = std::chrono::steady_clock::now();
  }

  c10::Device device_;
  std::unique_ptr<MemoryProbe> probe_;
  std::vector<at::Tensor> parameters_;
  py::object optimizer_state_;
  bool origins_;
  std::unique_ptr<MemoryMonitor> monitor_;
  std::optional<MemoryMonitor::Scope> scope_;
  Phase current_ = Phase::idle;
  int64_t step_ = 0;  // 0-based index of the step in flight
  int64_t start_live_ = 0;
  int64_t step_peak_ = 0;  // the step's highest before its latest phase began
  std::chrono::steady_clock::time_point start_;
  std::vector<StepLive> series_;
};

}  // namespace

void bind_memory(py::module_& m) {
  m.def(
      "install_cpu_allocator", [] { BudgetAllocator::install(); },
      "Counts every CPU allocation from now on (tensors made before are not counted).");
  m.def("set_skipped_prefixes", &set_skipped_prefixes,
        "Python files under these prefixes are passed over when naming where an allocation was made.");
  m.def(
      "set_cpu_budget",
      [](std::optional<int64_t> bytes) {
        if (bytes && *bytes <= 0) fail("cpu budget {}: accepted: a positive size", *bytes);
        BudgetAllocator::install().set_budget(bytes);
      },
      py::arg("bytes"));
  m.def("cpu_budget", [] { return BudgetAllocator::install().budget(); });
  m.def("cpu_live_bytes", [] { return BudgetAllocator::install().live_bytes(); });
  m.def("cpu_peak_bytes", [] { return BudgetAllocator::install().peak_bytes(); });
  m.def("reset_cpu_peak", [] { BudgetAllocator::install().reset_peak(); });
  m.def(
      "fail_nth_cpu_allocation", [](int64_t n) { BudgetAllocator::install().fail_nth_allocation(n); },
      "Fault injection: the n-th CPU allocation from now raises an out-of-memory error.");
  m.def("disarm_cpu_faults", [] { BudgetAllocator::install().disarm(); });
  m.def(
      "set_cpu_host_pool",
      [](bool host) { BudgetAllocator::install().set_pool(host ? MemoryPool::host : MemoryPool::device); },
      py::arg("host"),
      "True: cpu allocations from now on are host memory, counted apart from the budgeted device (offload).");
  m.def("cpu_host_live_bytes", [] { return BudgetAllocator::install().host_live_bytes(); });
  m.def("cpu_host_peak_bytes", [] { return BudgetAllocator::install().host_peak_bytes(); });
  m.def(
      "set_cpu_accounting", [](bool on) { BudgetAllocator::install().set_accounting(on); },
      "Off: cpu allocations pass straight to the system allocator, uncounted (to measure the counting's cost).");
  m.def(
      "parse_size", [](const std::string& text) { return parse_size(text, "size"); },
      "'8GiB', '512MB', '1.5G' or a number of bytes.");
  m.def("format_bytes", &format_bytes);

  py::class_<Monitor>(m, "Monitor")
      .def(py::init<const std::string&, std::vector<at::Tensor>, py::object, bool>(), py::arg("device"),
           py::arg("parameters"), py::arg("optimizer_state"), py::arg("python_frames"))
      .def("enter", &Monitor::enter)
      .def("exit", &Monitor::exit)
      .def("end_step", &Monitor::end_step, py::arg("loss"), py::arg("tokens"), py::arg("batch"), py::arg("accum"),
           py::arg("oom_recoveries"), py::arg("lr"), py::arg("grad_norm"))
      .def("abort_step", &Monitor::abort_step)
      .def("leak", &Monitor::leak, py::arg("warmup_steps"))
      .def("summary", &Monitor::summary)
      .def("live_bytes", &Monitor::live_bytes)
      .def("steps", &Monitor::steps)
      .def("source", &Monitor::source);
}

}  // namespace headroom::python
