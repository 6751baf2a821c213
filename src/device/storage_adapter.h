// Storage adapter — lets a tensor's memory go and come back while the tensor itself (its shape, its
// autograd identity, the references autograd saved to it) stays the same. ZeRO-3 keeps every
// parameter this way (dist/data_parallel.h), as FSDP does by resizing the storage to zero.
//
// The only place that reaches into c10::Storage's data pointer. The tensor must own a resizable
// storage it does not share with a tensor of another shape (a parameter made by at::empty).
#pragma once

#include <ATen/core/Tensor.h>

namespace headroom {

// The storage's memory goes back to its allocator; the tensor must not be read until restored.
void release_storage(const at::Tensor& t);
// Fresh memory for the whole storage from its allocator (contents undefined); no-op when present.
void restore_storage(const at::Tensor& t);
// A tensor of `sizes` (contiguous) holding no memory, as release_storage leaves one, made without
// allocating: restore_storage gives it its memory.
at::Tensor empty_shell(at::IntArrayRef sizes, const at::TensorOptions& options);
// The tensor takes `dtype` (its shape, autograd identity and hooks kept), holding no memory, as
// release_storage leaves it: restore_storage gives it memory of the new element size.
void become_shell(const at::Tensor& t, c10::ScalarType dtype);
// Whether the storage currently holds its memory.
bool storage_present(const at::Tensor& t);
// A flat view of t's elements over the same storage that autograd does not track (a version counter
// of its own): writing into it restores a value without looking like an in-place change to the
// copies of t that backward saved. t must be contiguous.
at::Tensor untracked_flat(const at::Tensor& t);

}  // namespace headroom
