#include "dist/data_parallel.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <unordered_map>

#include "device/grad_hook_adapter.h"

namespace headroom {
namespace {
int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
}  // namespace

DataParallel::DataParallel(Communicator& comm, const std::vector<NamedTensor>& params, ShardLevel level,
                           int64_t bucket_bytes)
    : comm_(comm), params_(params), level_(level), bucket_bytes_(bucket_bytes) {
  TORCH_CHECK(level != ShardLevel::full, "DataParallel: --shard full is not built");
  const int64_t n_ranks = comm.size(), r = comm.rank();
  int64_t offset = 0;
  for (const auto& p : params_) {
    Slice s;
    s.numel = p.tensor.numel();
    s.chunk = (s.numel + n_ranks - 1) / n_ranks;
    s.start = std::min(r * s.chunk, s.numel);
    s.length = std::min(s.chunk, s.numel - s.start);
    s.buffer_offset = offset;
    s.matrix = p.tensor.dim() >= 2;
    offset += s.chunk;
    slices_.push_back(s);
  }
  if (!sharded()) {
    optimizer_params_ = params_;
    return;
  }
  const c10::NoGradGuard no_grad;
  shard_grads_ = at::zeros({offset}, params_.front().tensor.options().requires_grad(false));
  for (size_t i = 0; i < params_.size(); ++i) {
    const Slice& s = slices_[i];
    if (s.length == 0) continue;
    at::Tensor view = params_[i].tensor.detach().view(-1).narrow(0, s.start, s.length);
    view.mutable_grad() = shard_grads_.narrow(0, s.buffer_offset, s.length);
    optimizer_params_.push_back({params_[i].name, view});
  }
  if (level_ == ShardLevel::gradients) {
    ready_.assign(params_.size(), false);
    for (size_t i = 0; i < params_.size(); ++i) {
      set_gradient_accumulated_hook(params_[i].tensor, [this, i](const at::Tensor&) {
        if (!in_backward_) return;
        ready_[i] = true;
        // In the fixed order: the last parameter first; a parameter finished early waits its turn.
        while (next_ < params_.size() && ready_[params_.size() - 1 - next_]) {
          reduce_parameter(params_.size() - 1 - next_, /*zeros=*/false);
        }
      });
    }
  }
}

DataParallel::~DataParallel() {
  if (level_ == ShardLevel::gradients) {
    for (const auto& p : params_) clear_gradient_accumulated_hook(p.tensor);
  }
}

bool DataParallel::is_matrix(const std::string& name) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].name == name) return slices_[i].matrix;
  }
  return false;
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
  const Slice& s = slices_[i];
  const at::Tensor& param = params_[i].tensor;
  const at::Tensor grad = zeros ? at::Tensor() : param.grad();
  const int64_t padded = s.chunk * comm_.size();
  at::Tensor input;
  if (grad.defined() && grad.is_contiguous() && padded == s.numel) {
    input = grad.view(-1);
  } else {
    input = at::zeros({padded}, shard_grads_.options());
    if (grad.defined()) input.narrow(0, 0, s.numel).copy_(grad.reshape(-1));
  }
  at::Tensor output = at::empty({s.chunk}, shard_grads_.options());
  comm_.reduce_scatter(output, input);
  if (level_ == ShardLevel::gradients) ++next_;
  shard_grads_.narrow(0, s.buffer_offset, s.chunk).add_(output);
  if (!zeros) param.mutable_grad().reset();
}

void DataParallel::begin_micro_batch() {
  if (level_ != ShardLevel::gradients) return;
  std::fill(ready_.begin(), ready_.end(), false);
  next_ = 0;
  in_backward_ = true;
}

void DataParallel::end_backward() {
  if (level_ != ShardLevel::gradients) return;
  in_backward_ = false;
  // Parameters that got no gradient this time still take part, with zeros.
  while (next_ < params_.size()) reduce_parameter(params_.size() - 1 - next_, /*zeros=*/true);
}

void DataParallel::abandon_backward() {
  if (level_ == ShardLevel::gradients) {
    in_backward_ = false;
    while (next_ < params_.size()) reduce_parameter(params_.size() - 1 - next_, /*zeros=*/true);
  }
  zero_grad();  // the step is lost: what was reduced into the shard included it
}

int DataParallel::agree(int code) {
  at::Tensor t = at::full({1}, static_cast<int64_t>(code), at::kLong);
  comm_.allreduce(t, ReduceOp::max);
  return static_cast<int>(t.item<int64_t>());
}

double DataParallel::sum(double value) {
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
  if (!sharded()) return;
  const c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Slice& s = slices_[i];
    at::Tensor flat = params_[i].tensor.detach().view(-1);
    at::Tensor input = at::empty({s.chunk}, flat.options());
    if (s.length > 0) input.narrow(0, 0, s.length).copy_(flat.narrow(0, s.start, s.length));
    if (s.chunk * comm_.size() == s.numel) {
      comm_.allgather(flat, input);
    } else {
      at::Tensor output = at::empty({s.chunk * comm_.size()}, flat.options());
      comm_.allgather(output, input);
      flat.copy_(output.narrow(0, 0, s.numel));
    }
  }
}

void DataParallel::zero_grad() {
  for (const auto& p : params_) p.tensor.mutable_grad().reset();
  if (sharded()) shard_grads_.zero_();
}

std::vector<at::Tensor> DataParallel::gradient_buffers() const {
  if (!sharded()) return {};
  return {shard_grads_};
}

}  // namespace headroom
