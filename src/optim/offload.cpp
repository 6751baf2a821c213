#include "optim/offload.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <optional>

#include "device/cuda_adapter.h"
#include "memory/host_pool.h"
#include "util/error.h"

namespace headroom {
namespace {

class OffloadedOptimizer final : public Optimizer {
 public:
  OffloadedOptimizer(OptimizerKind kind, const std::vector<NamedTensor>& params, const OptimizerOptions& options) {
    if (options.sharding) {
      fail("--offload optimizer does not combine with data-parallel ranks in this version; accepted: one process, or "
           "--shard optimizer to split the state over the ranks instead");
    }
    c10::NoGradGuard no_grad;
    HostPoolScope host;
    for (const NamedTensor& p : params) {
      Entry e;
      e.param = p.tensor;
      const bool cuda = p.tensor.is_cuda();
      // Meta parameters (the estimator's) keep meta copies: shapes only.
      const at::TensorOptions where = p.tensor.is_meta()
                                          ? p.tensor.options()
                                          : p.tensor.options().device(at::kCPU).pinned_memory(cuda);
      e.host = at::empty(p.tensor.sizes(), where);
      e.grad = at::empty(p.tensor.sizes(), where);
      if (!p.tensor.is_meta()) e.host.copy_(p.tensor);
      e.version = p.tensor._version();
      e.host.mutable_grad() = e.grad;
      e.optimizer = make_optimizer(kind, {{p.name, e.host}}, options);
      if (cuda && !copies_) copies_.emplace();
      entries_.push_back(std::move(e));
    }
  }

  std::string name() const override {
    return entries_.empty() ? "offloaded" : entries_.front().optimizer->name() + " (offloaded)";
  }
  bool offloaded() const override { return true; }

  std::vector<NamedTensor> state() const override {
    std::vector<NamedTensor> out;
    for (const Entry& e : entries_)
      for (NamedTensor& s : e.optimizer->state()) out.push_back(std::move(s));
    return out;
  }
  std::vector<at::Tensor> working_memory() const override {
    std::vector<at::Tensor> out;
    for (const Entry& e : entries_)
      for (at::Tensor& t : e.optimizer->working_memory()) out.push_back(std::move(t));
    return out;
  }
  std::vector<at::Tensor> host_copies() const override {
    std::vector<at::Tensor> out;
    for (const Entry& e : entries_) {
      out.push_back(e.host);
      out.push_back(e.grad);
    }
    return out;
  }

  void step(double lr) override {
    c10::NoGradGuard no_grad;
    std::vector<Entry*> stepped;
    for (Entry& e : entries_)
      if (e.param.grad().defined()) stepped.push_back(&e);
    if (copies_) {
      step_cuda(stepped, lr);
      return;
    }
    for (Entry* e : stepped) {
      down(*e, false);
      {
        HostPoolScope host;
        e->optimizer->step(lr);
      }
      up(*e, false);
    }
  }

 private:
  struct Entry {
    at::Tensor param, host, grad;
    int64_t version = 0;  // the parameter's version when the host copy last equalled it
    std::unique_ptr<Optimizer> optimizer;
  };

  // The gradient (and the parameter, when changed since the last copy back) to the host.
  static void down(Entry& e, bool non_blocking) {
    if (e.param._version() != e.version) e.host.copy_(e.param, non_blocking);
    e.grad.copy_(e.param.grad(), non_blocking);
  }
  static void up(Entry& e, bool non_blocking) {
    e.param.copy_(e.host, non_blocking);
    e.version = e.param._version();
  }

  // Every copy down queued first, each parameter updated as soon as its own has arrived, its copy
  // back queued behind the later copies down.
  void step_cuda(const std::vector<Entry*>& stepped, double lr) {
    CudaCopyStream& s = *copies_;
    s.after_compute();
    std::vector<int> arrived;
    arrived.reserve(stepped.size());
    for (Entry* e : stepped) arrived.push_back(s.queue([e] { down(*e, true); }));
    for (size_t i = 0; i < stepped.size(); ++i) {
      s.wait(arrived[i]);
      stepped[i]->optimizer->step(lr);
      s.queue([e = stepped[i]] { up(*e, true); });
    }
    s.before_compute();
  }

  std::vector<Entry> entries_;
  std::optional<CudaCopyStream> copies_;
};

}  // namespace

std::unique_ptr<Optimizer> make_offloaded_optimizer(OptimizerKind kind, const std::vector<NamedTensor>& params,
                                                    const OptimizerOptions& options) {
  return std::make_unique<OffloadedOptimizer>(kind, params, options);
}

}  // namespace headroom
