#include "model/activation_offload.h"

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include "memory/host_pool.h"

namespace headroom {

// One storage's bytes in host memory, and which storage (and version of it) they are.
struct ActivationOffload::HostCopy {
  at::Tensor bytes;  // uint8 [nbytes], host
  c10::weak_intrusive_ptr<c10::StorageImpl> source{c10::intrusive_ptr<c10::StorageImpl>()};
  int64_t version = 0;
};

namespace {

// What a saved tensor becomes: its storage's host copy and where in it the tensor lies.
struct Packed {
  at::Tensor host_bytes;
  c10::Device device{c10::kCPU};
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
};

}  // namespace

ActivationOffload::ActivationOffload(const std::vector<at::Tensor>& parameters) {
  for (const at::Tensor& p : parameters) parameters_.insert(p.storage().unsafeGetStorageImpl());
}

std::any ActivationOffload::pack(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return t;
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (parameters_.count(storage) > 0 || storage->nbytes() == 0) return t;
  std::shared_ptr<HostCopy>& copy = layer_copies_[storage];
  const int64_t version = t._version();
  if (!copy || copy->source.expired() || copy->version != version) {
    const auto nbytes = static_cast<int64_t>(storage->nbytes());
    auto fresh = std::make_shared<HostCopy>();
    {
      const HostPoolScope host;
      fresh->bytes = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(t.is_cuda()));
    }
    const at::Tensor source = at::from_blob(storage->mutable_data(), {nbytes},
                                            at::TensorOptions().dtype(at::kByte).device(t.device()));
    fresh->bytes.copy_(source);
    fresh->source = t.storage().getWeakStorageImpl();
    fresh->version = version;
    copy = std::move(fresh);
  }
  Packed p;
  p.host_bytes = copy->bytes;
  p.device = t.device();
  p.dtype = t.scalar_type();
  p.sizes = t.sizes().vec();
  p.strides = t.strides().vec();
  p.offset = t.storage_offset();
  return p;
}

at::Tensor ActivationOffload::unpack(const std::any& packed) {
  if (const auto* kept = std::any_cast<at::Tensor>(&packed)) return *kept;
  const auto& p = std::any_cast<const Packed&>(packed);
  at::Tensor bytes = at::empty({p.host_bytes.numel()}, at::TensorOptions().dtype(at::kByte).device(p.device));
  bytes.copy_(p.host_bytes);
  return bytes.view(p.dtype).as_strided(p.sizes, p.strides, p.offset);
}

}  // namespace headroom
