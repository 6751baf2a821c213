#include "model/activation_offload.h"

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include <unordered_map>

#include "device/cuda_adapter.h"
#include "memory/host_pool.h"

namespace headroom {

struct ActivationOffload::Layer {
  // One storage's bytes in host memory, and which storage (and version of it) they are.
  struct HostCopy {
    at::Tensor bytes;  // uint8 [nbytes], host
    c10::weak_intrusive_ptr<c10::StorageImpl> source{c10::intrusive_ptr<c10::StorageImpl>()};
    int64_t version = 0;
  };

  c10::Device device{c10::kCPU};
  std::vector<HostCopy> copies;                                // in the order they were made
  std::unordered_map<const c10::StorageImpl*, size_t> latest;  // while recorded: each storage's copy
  std::weak_ptr<Layer> below;
  std::shared_ptr<CudaCopyStream> stream;  // null on the cpu
  std::vector<at::Tensor> on_device;       // the copies back on the device (empty: not yet)
  bool entered = false;                    // backward has unpacked one of its tensors

  // Copies the host bytes back to the device: at once on the cpu, queued on the copy stream on cuda.
  void restore() {
    if (!on_device.empty() || copies.empty()) return;
    for (const HostCopy& c : copies) {
      on_device.push_back(at::empty({c.bytes.numel()}, at::TensorOptions().dtype(at::kByte).device(device)));
    }
    if (!stream) {
      for (size_t i = 0; i < copies.size(); ++i) on_device[i].copy_(copies[i].bytes);
      return;
    }
    stream->after_compute();  // the blocks may still be in use by earlier kernels
    stream->queue([this] {
      for (size_t i = 0; i < copies.size(); ++i) on_device[i].copy_(copies[i].bytes, /*non_blocking=*/true);
    });
    for (const at::Tensor& d : on_device) stream->hold(d);
  }
};

namespace {

// What a saved tensor becomes: its layer, which of the layer's copies holds its storage, and where
// in it the tensor lies.
struct Packed {
  std::shared_ptr<ActivationOffload::Layer> layer;
  size_t copy = 0;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
};

}  // namespace

ActivationOffload::ActivationOffload(const std::vector<at::Tensor>& parameters) {
  for (const at::Tensor& p : parameters) parameters_.insert(p.storage().unsafeGetStorageImpl());
}

ActivationOffload::~ActivationOffload() = default;

void ActivationOffload::start_forward() { previous_.reset(); }

ActivationOffload::LayerScope::LayerScope(ActivationOffload& owner) : owner_(owner), hooks_(owner.shared_from_this()) {
  owner_.open_ = std::make_shared<Layer>();
  owner_.open_->below = owner_.previous_;
}

ActivationOffload::LayerScope::~LayerScope() {
  owner_.open_->latest.clear();
  owner_.previous_ = owner_.open_;
  owner_.open_.reset();  // the packed tensors hold it from here
}

std::any ActivationOffload::pack(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return t;
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (parameters_.count(storage) > 0 || storage->nbytes() == 0) return t;
  Layer& layer = *open_;
  layer.device = t.device();
  const int64_t version = t._version();
  auto found = layer.latest.find(storage);
  if (found == layer.latest.end() || layer.copies[found->second].source.expired() ||
      layer.copies[found->second].version != version) {
    const auto nbytes = static_cast<int64_t>(storage->nbytes());
    Layer::HostCopy fresh;
    {
      const HostPoolScope host;
      fresh.bytes = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(t.is_cuda()));
    }
    const at::Tensor source =
        at::from_blob(storage->mutable_data(), {nbytes}, at::TensorOptions().dtype(at::kByte).device(t.device()));
    if (t.is_cuda()) {
      if (!copies_) copies_ = std::make_shared<CudaCopyStream>();
      layer.stream = copies_;
      copies_->after_compute();  // the copy reads what the forward has queued so far
      copies_->queue([&] { fresh.bytes.copy_(source, /*non_blocking=*/true); });
      copies_->hold(t);  // its storage is not reused before the copy has read it
    } else {
      fresh.bytes.copy_(source);
    }
    fresh.source = t.storage().getWeakStorageImpl();
    fresh.version = version;
    layer.copies.push_back(std::move(fresh));
    found = layer.latest.insert_or_assign(storage, layer.copies.size() - 1).first;
  }
  Packed p;
  p.layer = open_;
  p.copy = found->second;
  p.dtype = t.scalar_type();
  p.sizes = t.sizes().vec();
  p.strides = t.strides().vec();
  p.offset = t.storage_offset();
  return p;
}

at::Tensor ActivationOffload::unpack(const std::any& packed) {
  if (const auto* kept = std::any_cast<at::Tensor>(&packed)) return *kept;
  const auto& p = std::any_cast<const Packed&>(packed);
  Layer& layer = *p.layer;
  if (!layer.entered) {
    layer.entered = true;
    layer.restore();
    if (layer.stream) layer.stream->before_compute();  // this layer's copies are there before it runs
    if (const std::shared_ptr<Layer> below = layer.below.lock()) below->restore();
  }
  return layer.on_device[p.copy].view(p.dtype).as_strided(p.sizes, p.strides, p.offset);
}

}  // namespace headroom
