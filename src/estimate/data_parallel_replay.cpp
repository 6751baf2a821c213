#include "estimate/data_parallel_replay.h"

#include <fmt/format.h>

#include <algorithm>

namespace headroom::replay {

using sim::Category;
using sim::Param;
using sim::Ref;

DataParallelReplay::DataParallelReplay(sim::Memory& memory, const TrainSpec& s,
                                       const std::map<std::string, sim::Param>& params,
                                       const std::vector<std::string>& order, int ew, int compute_ew)
    : mem_(memory), s_(s), params_(params), order_(order), ew_(ew), compute_ew_(compute_ew) {}

void DataParallelReplay::prepare(const CausalLM& shapes) {
  if (s_.world > 1 || alone()) {
    comm_ = mem_.label("communication buffers", Category::communication,
                       "the collectives' flat buckets (unsharded: up to 25 MiB), padded gradients and "
                       "gathered parameters (sharded: one parameter at a time)");
  }
  if (sharded()) {
    shard_lbl_ = mem_.label("gradient shard", Category::gradients,
                            fmt::format("this rank's reduced gradients: ceil(n / {}) of each parameter's n elements × "
                                        "{} B{}",
                                        s_.world, ew_, fully_sharded() ? ", each made by its first reduction" : ""));
    int64_t elements = 0;
    for (const auto& name : order_) elements += chunk(params_.at(name).t.numel);
    // full: none until reduced (the slices' own .grad, made by the first reduction of a step).
    if (!fully_sharded()) shard_ = mem_.allocate(elements * ew_, shard_lbl_);
    slice_grads_.assign(order_.size(), nullptr);
  }
  if (reduces_in_backward()) {
    for (size_t i = 0; i < order_.size(); ++i) {
      params_.at(order_[i]).t.slot->on_accumulated = [this, i] { gradient_ready(i); };
    }
  }
  if (fully_sharded()) prepare_full_sharding(shapes);
}

int DataParallelReplay::slice_label() {
  return mem_.label("weight slices", Category::weights,
                    fmt::format("this rank's slice of each parameter: ceil(n / {}) elements × {} B", s_.world, ew_));
}

void DataParallelReplay::keep_slice(const std::string& name) {
  const int64_t n = params_.at(name).t.numel;
  kept_[name] = mem_.allocate(std::min(chunk(n), n) * ew_, slice_label());
}

void DataParallelReplay::prepare_full_sharding(const CausalLM& shapes) {
  const int slice_lbl = slice_label();
  gathered_lbl_ = mem_.label("gathered weights", Category::weights,
                             "parameters all-gathered while in use: the embeddings and head, and one layer");
  const std::vector<int> units = shapes.parameter_units();
  const std::vector<NamedTensor>& named = shapes.parameters();
  for (const auto& name : order_) {
    const int64_t n = params_.at(name).t.numel;
    // Kept as the model was built; else (a checkpoint filled the whole model) cut from it now.
    const auto kept = kept_.find(name);
    slices_.push_back(kept != kept_.end() ? kept->second : mem_.allocate(std::min(chunk(n), n) * ew_, slice_lbl));
    for (size_t k = 0; k < named.size(); ++k) {
      if (named[k].name == name) units_.push_back(units[k]);
    }
  }
  kept_.clear();
  unit_params_.resize(static_cast<size_t>(1 + *std::max_element(units_.begin(), units_.end())));
  for (size_t i = 0; i < order_.size(); ++i) unit_params_[static_cast<size_t>(units_[i])].push_back(i);
  gathered_.resize(unit_params_.size());
  arrived_.assign(unit_params_.size(), 0);
}

void DataParallelReplay::start_micro_batch() {
  if (reduces_in_backward()) {
    ready_.assign(order_.size(), false);
    std::fill(arrived_.begin(), arrived_.end(), 0);
    next_ = 0;
  }
}

void DataParallelReplay::reduce_scatter(size_t i, bool zeros) {
  const Param& prm = params_.at(order_[i]);
  const int64_t n = prm.t.numel, c = chunk(n);
  if (alone()) {
    // The slice's gradient (DataParallel::accumulate_shard): the first a float32 copy of the
    // bfloat16 one; a later one added, which on cpu reads it through a float32 copy of it
    // (TensorIterator's input promotion).
    if (!zeros) {
      if (!slice_grads_[i]) {
        slice_grads_[i] = mem_.allocate(n * ew_, shard_lbl_);
      } else if (!s_.cuda) {
        Ref cast = mem_.allocate(n * ew_, comm_);
      }
    }
    if (reduces_in_backward()) ++next_;
    if (!zeros) prm.t.slot->grad.reset();
    return;
  }
  Ref grad = zeros ? nullptr : prm.t.slot->grad;
  // Padded to N chunks in a zeroed copy unless the gradient already is exactly that (bf16-params: a
  // float32 copy of the bfloat16 gradient, always).
  const bool copied = !grad || c * s_.world != n || compute_ew_ != ew_;
  Ref input = copied ? mem_.allocate(c * s_.world * ew_, comm_) : nullptr;
  if (copied) {  // the gradient goes once copied, before the collective's buffers
    grad.reset();
    if (!zeros) prm.t.slot->grad.reset();
  }
  Ref output = mem_.allocate(c * ew_, comm_);
  if (gloo_buffers()) {
    // Gloo reduce-scatters by reducing a flat copy of the whole input and copying this rank's chunk
    // out of it into the output: one transient of the input's size (measured: gpt_neox's untied
    // 50304 x 768 head at 2 ranks; no second, chunk-sized one).
    Ref copy = mem_.allocate(c * s_.world * ew_, comm_);
  }
  if (reduces_in_backward()) ++next_;
  // full: the first reduction's buffer becomes the slice's gradient (rank 0's slice is a whole chunk).
  if (fully_sharded() && !slice_grads_[i]) {
    mem_.relabel(output, shard_lbl_);
    slice_grads_[i] = output;
  }
  if (!zeros) prm.t.slot->grad.reset();
  output.reset();
  input.reset();
}

void DataParallelReplay::gradient_ready(size_t i) {
  ready_[i] = true;
  while (next_ < order_.size() && ready_[order_.size() - 1 - next_]) reduce_scatter(order_.size() - 1 - next_, false);
  if (fully_sharded()) {
    const auto unit = static_cast<size_t>(units_[i]);
    if (++arrived_[unit] == unit_params_[unit].size()) release(static_cast<int>(unit));
  }
}

void DataParallelReplay::finish_backward() {
  if (!reduces_in_backward()) return;
  while (next_ < order_.size()) reduce_scatter(order_.size() - 1 - next_, true);
  for (size_t u = 0; u < gathered_.size(); ++u) release(static_cast<int>(u));
}

void DataParallelReplay::after_backward() {
  if (s_.world > 1 || alone()) {
    finish_backward();
    agreement();
  }
}

void DataParallelReplay::gather(int unit) {
  auto& held = gathered_.at(static_cast<size_t>(unit));
  if (!held.empty()) return;
  for (size_t i : unit_params_[static_cast<size_t>(unit)]) {
    const int64_t n = params_.at(order_[i]).t.numel, c = chunk(n);
    held.push_back(mem_.allocate(n * compute_ew_, gathered_lbl_));
    // Rank 0's slice is a whole chunk: sent as it is, unpadded (bf16-params: cast first).
    Ref cast = compute_ew_ != ew_ ? mem_.allocate(c * compute_ew_, comm_) : nullptr;
    allgather(n, c, compute_ew_);
  }
}

void DataParallelReplay::release(int unit) { gathered_.at(static_cast<size_t>(unit)).clear(); }

// The embeddings and head (unit 0) are kept for backward while gradients are recorded, and every
// layer without resharding after the forward.
void DataParallelReplay::forward_done(int unit, bool recording) {
  if (!recording || (unit != 0 && s_.reshard_after_forward)) release(unit);
}

void DataParallelReplay::before_update() {
  if (s_.world > 1 || alone()) {
    Ref loss_sum = mem_.allocate(8, comm_);  // the global batch's loss, summed over the ranks
    if (alone()) return;                     // fully sharded: reduced during backward
    if (s_.shard == ShardLevel::none) allreduce_buckets();
    if (s_.shard == ShardLevel::optimizer) {
      for (size_t k = order_.size(); k-- > 0;) reduce_scatter(k, false);
    }
  }
}

void DataParallelReplay::zero_grad() {
  if (fully_sharded()) std::fill(slice_grads_.begin(), slice_grads_.end(), nullptr);
}

void DataParallelReplay::after_update() {
  if (sharded() && !fully_sharded()) gather_parameters();
}

void DataParallelReplay::allreduce_buckets() {
  constexpr int64_t kBucketBytes = int64_t{25} << 20;
  std::vector<int64_t> bucket;
  auto flush = [&] {
    // One gradient is reduced in place; several are copied into one flat buffer and back.
    if (bucket.size() > 1) {
      int64_t bytes = 0;
      for (int64_t b : bucket) bytes += b;
      Ref flat = mem_.allocate(bytes, comm_);
    }
    bucket.clear();
  };
  int64_t bytes = 0;
  for (size_t k = order_.size(); k-- > 0;) {
    const int64_t g = params_.at(order_[k]).t.numel * ew_;
    if (!bucket.empty() && bytes + g > kBucketBytes) {
      flush();
      bytes = 0;
    }
    bucket.push_back(g);
    bytes += g;
  }
  flush();
}

void DataParallelReplay::gather_parameters() {
  for (const auto& name : order_) {
    const int64_t n = params_.at(name).t.numel, c = chunk(n);
    Ref input = mem_.allocate(c * ew_, comm_);
    allgather(n, c, ew_);
  }
}

void DataParallelReplay::allgather(int64_t n, int64_t c, int elem) {
  Ref output = c * s_.world != n ? mem_.allocate(c * s_.world * elem, comm_) : nullptr;
  // On cpu Gloo gathers into a flat tensor of its own and copies the result out of it.
  if (gloo_buffers()) Ref flat = mem_.allocate(c * s_.world * elem, comm_);
}

}  // namespace headroom::replay
