#include "dist/data_parallel.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "device/grad_hook_adapter.h"
#include "device/storage_adapter.h"
#include "util/error.h"
#include "util/files.h"

namespace headroom {
namespace {
int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
}  // namespace

class DataParallel::Tagged {
 public:
  Tagged(DataParallel& dp, AllocationTag tag) : dp_(dp), previous_(dp.current_tag_) { set(tag); }
  ~Tagged() { set(previous_); }
  Tagged(const Tagged&) = delete;
  Tagged& operator=(const Tagged&) = delete;

 private:
  void set(AllocationTag tag) {
    if (tag == dp_.current_tag_) return;
    dp_.current_tag_ = tag;
    if (dp_.tag_) dp_.tag_(tag);
  }
  DataParallel& dp_;
  AllocationTag previous_;
};

DataParallel::DataParallel(Communicator& comm, const std::vector<NamedTensor>& params, ShardLevel level,
                           std::vector<int> units, std::vector<at::Tensor> slices, FullSharding full,
                           int64_t bucket_bytes)
    : comm_(comm),
      params_(params),
      level_(level),
      full_(full),
      bucket_bytes_(bucket_bytes),
      weight_slices_(std::move(slices)),
      units_(std::move(units)) {
  TORCH_CHECK(level != ShardLevel::full || units_.size() == params_.size(),
              "DataParallel: --shard full needs the unit of every parameter");
  const int64_t n_ranks = comm.size(), r = comm.rank();
  int64_t offset = 0;
  for (const auto& p : params_) {
    Slice s;
    s.numel = p.tensor.numel();
    s.chunk = (s.numel + n_ranks - 1) / n_ranks;
    s.start = std::min(r * s.chunk, s.numel);
    s.length = std::min(s.chunk, s.numel - s.start);
    s.buffer_offset = offset;
    offset += s.chunk;
    slices_.push_back(s);
  }
  if (!sharded()) {
    optimizer_params_ = params_;
    return;
  }
  const c10::NoGradGuard no_grad;
  grad_options_ = params_.front().tensor.options().requires_grad(false);
  // full: each slice's gradient made by its first reduction, dropped by zero_grad (as FSDP2's are).
  if (level_ != ShardLevel::full) shard_grads_ = at::zeros({offset}, grad_options_);
  for (size_t i = 0; i < params_.size(); ++i) {
    const Slice& s = slices_[i];
    at::Tensor view;
    if (level_ != ShardLevel::full) {
      view = params_[i].tensor.detach().view(-1).narrow(0, s.start, s.length);
    } else {
      // The slice in memory of its own (kept while the model was built, or cut here); the
      // parameter lets its memory go until gathered.
      if (weight_slices_.size() < params_.size()) {
        weight_slices_.push_back(weight_slice(params_[i].tensor, static_cast<int>(r), static_cast<int>(n_ranks)));
      }
      view = weight_slices_[i];
      TORCH_CHECK(view.numel() == s.length, "DataParallel: the kept slice of ", params_[i].name, " has ", view.numel(),
                  " elements, not ", s.length);
      release_storage(params_[i].tensor);
      if (full_.compute) become_shell(params_[i].tensor, *full_.compute);
    }
    if (s.length == 0) continue;
    if (level_ != ShardLevel::full) view.mutable_grad() = shard_grads_.narrow(0, s.buffer_offset, s.length);
    optimizer_params_.push_back({params_[i].name, view});
  }
  if (level_ == ShardLevel::full) {
    const int n_units = 1 + *std::max_element(units_.begin(), units_.end());
    unit_params_.resize(static_cast<size_t>(n_units));
    for (size_t i = 0; i < params_.size(); ++i) unit_params_[static_cast<size_t>(units_[i])].push_back(i);
    gathered_.assign(unit_params_.size(), false);
    arrived_.assign(unit_params_.size(), 0);
  }
  if (reduces_in_backward()) {
    ready_.assign(params_.size(), false);
    for (size_t i = 0; i < params_.size(); ++i) {
      set_gradient_accumulated_hook(params_[i].tensor, [this, i](const at::Tensor&) {
        if (!in_backward_) return;
        ready_[i] = true;
        // In the fixed order: the last parameter first; a parameter finished early waits its turn.
        while (next_ < params_.size() && ready_[params_.size() - 1 - next_]) {
          reduce_parameter(params_.size() - 1 - next_, /*zeros=*/false);
        }
        // full: backward is done with a unit once all its gradients are in.
        if (level_ == ShardLevel::full) {
          const auto unit = static_cast<size_t>(units_[i]);
          if (++arrived_[unit] == unit_params_[unit].size()) release(static_cast<int>(unit));
        }
      });
    }
  }
}

DataParallel::~DataParallel() {
  if (reduces_in_backward()) {
    for (const auto& p : params_) clear_gradient_accumulated_hook(p.tensor);
  }
}

at::Tensor DataParallel::weight_slice(const at::Tensor& param, int rank, int ranks) {
  const c10::NoGradGuard no_grad;
  const int64_t n = param.numel(), c = (n + ranks - 1) / ranks;
  const int64_t start = std::min(rank * c, n);
  return param.detach().reshape(-1).narrow(0, start, std::min(c, n - start)).clone();
}

std::optional<OptimizerSharding> DataParallel::optimizer_sharding() {
  if (!sharded()) return std::nullopt;
  OptimizerSharding out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.parameters.push_back({params_[i].name, params_[i].tensor.sizes().vec(), slices_[i].start, slices_[i].length});
  }
  out.sum = [this](at::Tensor& t) {
    const Tagged buffers(*this, AllocationTag::communication);
    comm_.allreduce(t, ReduceOp::sum);
  };
  return out;
}

std::optional<std::pair<int64_t, int64_t>> DataParallel::slice_of(const std::string& name) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].name != name) continue;
    if (!sharded()) return std::make_pair(int64_t{0}, slices_[i].numel);
    return std::make_pair(slices_[i].start, slices_[i].length);
  }
  return std::nullopt;
}

void DataParallel::reduce_parameter(size_t i, bool zeros) {
  const c10::NoGradGuard no_grad;
  const Tagged buffers(*this, AllocationTag::communication);
  const Slice& s = slices_[i];
  const at::Tensor& param = params_[i].tensor;
  at::Tensor grad = zeros ? at::Tensor() : param.grad();
  if (comm_.size() == 1) {
    // Alone (bf16-params on one process): the gradient is the slice's, in its dtype (cast).
    if (grad.defined()) accumulate_shard(i, grad.reshape(-1));
    if (reduces_in_backward()) ++next_;
    if (level_ == ShardLevel::full) issued_.push_back({false, i});
    if (!zeros) param.mutable_grad().reset();
    return;
  }
  const int64_t padded = s.chunk * comm_.size();
  at::Tensor input;
  // bf16-params: a bfloat16 gradient is reduced in the shard's float32 (cast in the copy).
  if (grad.defined() && grad.is_contiguous() && padded == s.numel && grad.scalar_type() == grad_options_.dtype()) {
    input = grad.view(-1);
  } else {
    input = at::zeros({padded}, grad_options_);
    if (grad.defined()) input.narrow(0, 0, s.numel).copy_(grad.reshape(-1));
    // Copied: the gradient goes before the collective's own buffers come (as FSDP2 frees it).
    grad.reset();
    if (!zeros) param.mutable_grad().reset();
  }
  // full: the first reduction's output becomes the slice's gradient — not a collective's buffer.
  const bool kept = level_ == ShardLevel::full && s.length == s.chunk && !weight_slices_[i].grad().defined();
  at::Tensor output;
  {
    const Tagged as(*this, kept ? AllocationTag::none : AllocationTag::communication);
    output = at::empty({s.chunk}, grad_options_);
  }
  comm_.reduce_scatter(output, input);
  if (reduces_in_backward()) ++next_;
  if (level_ == ShardLevel::full) issued_.push_back({false, i});
  accumulate_shard(i, output);
  if (!zeros) param.mutable_grad().reset();
}

void DataParallel::accumulate_shard(size_t i, const at::Tensor& reduced) {
  const Slice& s = slices_[i];
  if (level_ != ShardLevel::full) {
    shard_grads_.narrow(0, s.buffer_offset, s.chunk).add_(reduced);
    return;
  }
  if (s.length == 0) return;
  at::Tensor& grad = weight_slices_[i].mutable_grad();
  const at::Tensor part = reduced.narrow(0, 0, s.length);
  if (grad.defined()) {
    grad.add_(part);
  } else if (s.length == s.chunk && reduced.scalar_type() == grad_options_.dtype()) {
    grad = reduced;  // the reduction's own buffer (no copy)
  } else {
    const Tagged as(*this, AllocationTag::none);  // a gradient, not a collective's buffer
    grad = part.to(grad_options_.dtype(), /*non_blocking=*/false, /*copy=*/true);
  }
}

void DataParallel::begin_micro_batch() {
  if (!reduces_in_backward()) return;
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(arrived_.begin(), arrived_.end(), 0);
  issued_.clear();
  next_ = 0;
  in_backward_ = true;
}

void DataParallel::reduce_remaining() {
  in_backward_ = false;
  while (next_ < params_.size()) reduce_parameter(params_.size() - 1 - next_, /*zeros=*/true);
}

void DataParallel::end_backward() {
  if (!reduces_in_backward()) return;
  // Parameters that got no gradient this time still take part, with zeros.
  reduce_remaining();
  release_all();
  if (level_ == ShardLevel::full) pattern_ = issued_;
}

void DataParallel::abandon_backward() {
  if (comm_.size() == 1) {  // alone: no one waits in a collective
    in_backward_ = false;
    release_all();
    zero_grad();
    return;
  }
  if (level_ == ShardLevel::full) {
    in_backward_ = false;
    release_all();  // what the failed forward or backward had gathered
    const bool prefix =
        issued_.size() <= pattern_.size() && std::equal(issued_.begin(), issued_.end(), pattern_.begin());
    if (pattern_.empty() || !prefix) {
      zero_grad();
      fail(
          "rank {}: out of memory at --shard full {}, so the other ranks' collectives cannot be matched to "
          "recover together; accepted: a smaller --batch, or --shard gradients",
          comm_.rank(),
          pattern_.empty() ? "before any micro-batch had completed" : "in a micro-batch unlike the ones before");
    }
    // The rest of the micro-batch's collectives, with zeros, in the order the others issue them.
    completing_owed_collectives([this] {
      for (size_t k = issued_.size(); k < pattern_.size(); ++k) {
        const Collective c = pattern_[k];
        if (c.gather) {
          gather_zeros(c.param);
        } else {
          reduce_parameter(c.param, /*zeros=*/true);
        }
      }
    });
  } else if (reduces_in_backward()) {
    completing_owed_collectives([this] { reduce_remaining(); });
  }
  zero_grad();  // the step is lost: what was reduced into the shard included it
}

void DataParallel::completing_owed_collectives(const std::function<void()>& owed) {
  try {
    owed();
  } catch (const c10::OutOfMemoryError& e) {
    // Not an OOM the guard may act on: this rank would leave the others inside a collective.
    fail("rank {}: out of memory again while completing the collectives the other ranks wait in ({}), so the "
         "ranks cannot recover together; accepted: a smaller --batch, or more memory",
         comm_.rank(), first_line(e.what_without_backtrace()));
  }
}

void DataParallel::gather_zeros(size_t param) {
  const c10::NoGradGuard no_grad;
  const Tagged buffers(*this, AllocationTag::communication);
  const int64_t chunk = slices_[param].chunk;
  // In the dtype the others gather in (the parameters', bf16-params' bfloat16 included).
  const at::TensorOptions options = params_[param].tensor.options().requires_grad(false);
  at::Tensor output = at::empty({chunk * comm_.size()}, options);
  at::Tensor input = at::zeros({chunk}, options);
  comm_.allgather(output, input);
}

void DataParallel::begin_forward() { issued_.clear(); }

void DataParallel::abandon_forward() {
  if (level_ != ShardLevel::full) return;
  release_all();
  std::vector<size_t> order;  // a forward's gathers: unit 0's parameters, then each layer's
  for (const auto& unit : unit_params_) order.insert(order.end(), unit.begin(), unit.end());
  completing_owed_collectives([&] {
    for (size_t k = issued_.size(); k < order.size(); ++k) gather_zeros(order[k]);
  });
}

void DataParallel::gather(int unit) {
  const auto u = static_cast<size_t>(unit);
  if (gathered_.at(u)) return;
  const c10::NoGradGuard no_grad;
  for (size_t i : unit_params_[u]) {
    const Slice& s = slices_[i];
    {
      const Tagged gathered(*this, AllocationTag::gathered_weights);
      restore_storage(params_[i].tensor);
    }
    // Written through an alias autograd does not track: the values come back unchanged, and
    // backward's saved references to the parameter must not see a modification.
    at::Tensor flat = untracked_flat(params_[i].tensor);
    const Tagged buffers(*this, AllocationTag::communication);
    // In the parameter's dtype (bf16-params: the float32 slice cast), padded to a whole chunk.
    at::Tensor input = weight_slices_[i];
    if (s.length != s.chunk) {
      input = at::zeros({s.chunk}, flat.options());
      input.narrow(0, 0, s.length).copy_(weight_slices_[i]);
    } else if (input.scalar_type() != flat.scalar_type()) {
      input = input.to(flat.scalar_type());
    }
    allgather_into(flat, input, s);
    issued_.push_back({true, i});
  }
  gathered_[u] = true;
}

void DataParallel::forward_done(int unit) {
  // Backward starts with the head (unit 0) right after the forward: keep it when one will follow; a
  // layer too without resharding after the forward.
  if ((unit == 0 || !full_.reshard_after_forward) && c10::GradMode::is_enabled()) return;
  release(unit);
}

void DataParallel::release(int unit) {
  const auto u = static_cast<size_t>(unit);
  if (!gathered_.at(u)) return;
  for (size_t i : unit_params_[u]) release_storage(params_[i].tensor);
  gathered_[u] = false;
}

void DataParallel::release_all() {
  // Every parameter, not only the units marked gathered: a gather cut short by an OOM leaves some.
  if (level_ != ShardLevel::full) return;
  for (const auto& p : params_) {
    if (storage_present(p.tensor)) release_storage(p.tensor);
  }
  std::fill(gathered_.begin(), gathered_.end(), false);
}

int DataParallel::agree(int code) {
  const Tagged buffers(*this, AllocationTag::communication);
  at::Tensor t = at::full({1}, static_cast<int64_t>(code), at::kLong);
  comm_.allreduce(t, ReduceOp::max);
  return static_cast<int>(t.item<int64_t>());
}

double DataParallel::sum(double value) {
  const Tagged buffers(*this, AllocationTag::communication);
  at::Tensor t = at::full({1}, value, at::kDouble);
  comm_.allreduce(t, ReduceOp::sum);
  return t.item<double>();
}

bool DataParallel::any(bool flag) { return agree(flag ? 1 : 0) != 0; }

void DataParallel::allreduce_buckets() {
  const c10::NoGradGuard no_grad;
  std::vector<at::Tensor> bucket;
  int64_t bucket_bytes = 0;
  auto flush = [&] {
    if (bucket.empty()) return;
    const Tagged buffers(*this, AllocationTag::communication);
    if (bucket.size() == 1 && bucket.front().is_contiguous()) {
      comm_.allreduce(bucket.front());  // one tensor: in place, no copy
    } else {
      std::vector<at::Tensor> flat_views;
      for (const auto& g : bucket) flat_views.push_back(g.reshape(-1));
      at::Tensor flat = at::cat(flat_views);
      comm_.allreduce(flat);
      int64_t off = 0;
      for (auto& g : bucket) {
        g.view(-1).copy_(flat.narrow(0, off, g.numel()));
        off += g.numel();
      }
    }
    bucket.clear();
    bucket_bytes = 0;
  };
  // Last parameter first, as backward finishes them.
  for (size_t k = params_.size(); k-- > 0;) {
    const at::Tensor& p = params_[k].tensor;
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);  // every rank sends the same layout
    at::Tensor g = p.grad();
    if (!bucket.empty() && (bucket_bytes + bytes_of(g) > bucket_bytes_ || g.scalar_type() != bucket.front().scalar_type())) {
      flush();
    }
    bucket.push_back(g);
    bucket_bytes += bytes_of(g);
  }
  flush();
}

void DataParallel::reduce_gradients() {
  switch (level_) {
    case ShardLevel::none: allreduce_buckets(); break;
    case ShardLevel::optimizer:
      for (size_t k = params_.size(); k-- > 0;) reduce_parameter(k, /*zeros=*/false);
      break;
    case ShardLevel::gradients:
    case ShardLevel::full: break;  // done during backward
  }
}

std::vector<at::Tensor> DataParallel::gradients() const {
  std::vector<at::Tensor> out;
  for (const auto& p : optimizer_params_) {
    if (p.tensor.grad().defined()) out.push_back(p.tensor.grad());
  }
  return out;
}

double DataParallel::clip_grad_norm(double max_norm) {
  const c10::NoGradGuard no_grad;
  const std::vector<at::Tensor> grads = gradients();
  at::Tensor squares = at::zeros({1}, at::kFloat);
  if (!grads.empty()) {
    auto norms = at::_foreach_norm(grads, 2);
    squares = at::stack(norms).to(at::kFloat).pow(2).sum().reshape({1});
  }
  // Sharded: each rank holds a part of the gradient; the norm is over all of it.
  if (sharded()) comm_.allreduce(squares);
  const double norm = std::sqrt(squares.item<double>());
  if (max_norm > 0 && norm > max_norm && !grads.empty()) at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
  return norm;
}

void DataParallel::gather_parameters() {
  if (!sharded() || level_ == ShardLevel::full) return;  // full: the slices are the weights
  const c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Slice& s = slices_[i];
    at::Tensor flat = params_[i].tensor.detach().view(-1);
    const Tagged buffers(*this, AllocationTag::communication);
    at::Tensor input = at::empty({s.chunk}, flat.options());
    if (s.length > 0) input.narrow(0, 0, s.length).copy_(flat.narrow(0, s.start, s.length));
    allgather_into(flat, input, s);
  }
}

void DataParallel::allgather_into(at::Tensor& flat, at::Tensor& chunk, const Slice& s) {
  if (s.chunk * comm_.size() == s.numel) {
    comm_.allgather(flat, chunk);
    return;
  }
  at::Tensor output = at::empty({s.chunk * comm_.size()}, flat.options());  // N chunks overrun the parameter
  comm_.allgather(output, chunk);
  flat.copy_(output.narrow(0, 0, s.numel));
}

void DataParallel::zero_grad() {
  for (const auto& p : params_) p.tensor.mutable_grad().reset();
  if (level_ == ShardLevel::full) {
    for (const at::Tensor& slice : weight_slices_) slice.mutable_grad().reset();
  } else if (sharded()) {
    shard_grads_.zero_();
  }
}

std::vector<at::Tensor> DataParallel::gradient_buffers() const {
  if (!sharded()) return {};
  if (level_ != ShardLevel::full) return {shard_grads_};
  std::vector<at::Tensor> out;
  for (const at::Tensor& slice : weight_slices_) {
    if (slice.grad().defined()) out.push_back(slice.grad());
  }
  return out;
}

std::vector<NamedTensor> DataParallel::checkpoint_weights() const {
  if (level_ != ShardLevel::full) return params_;
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < params_.size(); ++i) out.push_back({params_[i].name, weight_slices_[i]});
  return out;
}

}  // namespace headroom
