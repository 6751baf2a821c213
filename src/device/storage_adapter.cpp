#include "device/storage_adapter.h"

#include <ATen/ATen.h>
#include <c10/core/Storage.h>

#include "util/error.h"

namespace headroom {
namespace {

size_t storage_bytes_needed(const at::Tensor& t) {
  return static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();
}

}  // namespace

void release_storage(const at::Tensor& t) {
  const c10::Storage& s = t.storage();
  if (!s.resizable() || s.allocator() == nullptr) fail("release_storage: the tensor's storage is not resizable");
  s.set_data_ptr_noswap(s.allocator()->allocate(0));
  s.set_nbytes(0);
}

void restore_storage(const at::Tensor& t) {
  const c10::Storage& s = t.storage();
  const size_t bytes = storage_bytes_needed(t);
  if (s.nbytes() >= bytes) return;
  s.set_data_ptr_noswap(s.allocator()->allocate(bytes));
  s.set_nbytes(bytes);
}

at::Tensor empty_shell(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor shell = at::empty({0}, options);
  shell.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return shell;
}

void become_shell(const at::Tensor& t, c10::ScalarType dtype) {
  t.set_data(empty_shell(t.sizes(), t.options().dtype(dtype).requires_grad(false)));
}

bool storage_present(const at::Tensor& t) { return t.storage().nbytes() >= storage_bytes_needed(t); }

at::Tensor untracked_flat(const at::Tensor& t) {
  if (!t.is_contiguous()) fail("untracked_flat: the tensor is not contiguous");
  at::Tensor flat = at::empty({0}, t.options().requires_grad(false));
  flat.set_(t.storage(), t.storage_offset(), {t.numel()}, {1});
  return flat;
}

}  // namespace headroom
