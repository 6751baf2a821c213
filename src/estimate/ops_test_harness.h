// The operator table's harness (ops_test.cpp): one real call of an operator measured under the
// budget allocator, and the estimator's replay of the same call.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "estimate/ops.h"
#include "memory/budget_allocator.h"

namespace headroom::operator_table {

struct Measure {
  int64_t forward_kept = 0, forward_peak = 0, backward_peak = 0, backward_kept = 0;
};

// One real call: `inputs` made first (their bytes are the baseline), then the operator, then
// backward from a gradient of ones.
inline Measure measure_real(const std::function<std::vector<at::Tensor>()>& inputs,
                     const std::function<at::Tensor(const std::vector<at::Tensor>&)>& op) {
  BudgetAllocator& a = BudgetAllocator::install();
  const std::vector<at::Tensor> in = inputs();
  Measure m;
  const int64_t before = a.live_bytes();
  a.reset_peak();
  const at::Tensor out = op(in);
  m.forward_kept = a.live_bytes() - before;
  m.forward_peak = a.peak_bytes() - before;
  const at::Tensor seed = at::ones_like(out);
  const int64_t seeded = a.live_bytes();
  a.reset_peak();
  out.backward(seed);
  m.backward_peak = a.peak_bytes() - seeded;
  m.backward_kept = a.live_bytes() - seeded;
  return m;
}

// The model's side: an Ops whose inputs are leaves (their gradients kept, as .grad keeps them).
class Replay : public sim::Ops {
 public:
  explicit Replay(bool mixed) : sim::Ops(mixed) {
    leaf_ = mem_.label("leaf gradients", sim::Category::gradients);
    input_ = mem_.label("inputs", sim::Category::other);
    cache_ = &cache_map_;
  }
  sim::Tensor leaf(int64_t numel, int elem) {
    sim::Tensor t = make(numel, elem, input_, true);
    t.slot->param_label = leaf_;
    return t;
  }
  sim::Tensor constant(int64_t numel, int elem) { return make(numel, elem, input_, false); }
  sim::Param param(int64_t rows, int64_t cols, int elem) {
    sim::Param p;
    p.t = leaf(rows * std::max<int64_t>(cols, 1), elem);
    p.rows = rows;
    p.cols = cols;
    return p;
  }
  int label() { return act("output", ""); }
  int input_label() const { return input_; }

  Measure measure(const std::function<sim::Tensor()>& op) {
    Measure m;
    const int64_t before = mem_.live();
    mem_.reset_peak();
    sim::Tensor out = op();
    cache_map_.clear();  // the autocast scope closes
    m.forward_kept = mem_.live() - before;
    m.forward_peak = mem_.peak().bytes - before;
    sim::Ref seed = mem_.allocate(out.bytes(), tmp_);
    const int64_t seeded = mem_.live();
    mem_.reset_peak();
    g_->backward(out, seed);
    m.backward_peak = mem_.peak().bytes - seeded;
    m.backward_kept = mem_.live() - seeded;
    return m;
  }

 private:
  int leaf_, input_;
  std::map<const sim::Param*, sim::Tensor> cache_map_;
};

struct Case {
  std::string op;  // the name in modeled_operators()
  std::string description;
  std::function<Measure()> real, model;
};
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.op << ": " << c.description; }

inline at::Tensor leaf(std::vector<int64_t> shape, at::ScalarType dtype = at::kFloat) {
  return at::randn(shape, at::TensorOptions().dtype(dtype)).requires_grad_(true);
}

}  // namespace headroom::operator_table
