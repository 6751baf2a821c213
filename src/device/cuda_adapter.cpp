#include "device/cuda_adapter.h"

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/memory_snapshot.h>

#include <atomic>
#include <memory>
#include <vector>

#include "util/error.h"

namespace headroom {
namespace {

// The (step, phase) the next allocation is made in; read by the allocator's context recorder, a
// plain function pointer, hence globals.
std::atomic<int64_t> g_origin_step{-1};
std::atomic<int> g_origin_phase{0};

struct AllocationOrigin final : c10::GatheredContext {
  int64_t step = -1;
  int phase = 0;
};

std::shared_ptr<c10::GatheredContext> record_origin() {
  auto origin = std::make_shared<AllocationOrigin>();
  origin->step = g_origin_step.load(std::memory_order_relaxed);
  origin->phase = g_origin_phase.load(std::memory_order_relaxed);
  return origin;
}

}  // namespace

bool cuda_available() { return c10::cuda::device_count() > 0; }

int cuda_device_count() { return c10::cuda::device_count(); }

void cuda_set_device(int device) { c10::cuda::set_device(static_cast<c10::DeviceIndex>(device)); }

void cuda_init() { at::globalContext().lazyInitDevice(c10::DeviceType::CUDA); }

void cuda_synchronize(int device) {
  if (device < 0) {
    c10::cuda::device_synchronize();
    return;
  }
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  c10::cuda::device_synchronize();
}

CudaMemoryStats cuda_memory_stats(int device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  CudaMemoryStats out;
  out.allocated_bytes = stats.allocated_bytes[kAll].current;
  out.peak_allocated_bytes = stats.allocated_bytes[kAll].peak;
  out.reserved_bytes = stats.reserved_bytes[kAll].current;
  out.peak_reserved_bytes = stats.reserved_bytes[kAll].peak;
  out.active_bytes = stats.active_bytes[kAll].current;
  out.peak_active_bytes = stats.active_bytes[kAll].peak;
  out.inactive_split_bytes = stats.inactive_split_bytes[kAll].current;
  out.peak_inactive_split_bytes = stats.inactive_split_bytes[kAll].peak;
  out.requested_bytes = stats.requested_bytes[kAll].current;
  out.peak_requested_bytes = stats.requested_bytes[kAll].peak;
  out.alloc_retries = stats.num_alloc_retries;
  out.ooms = stats.num_ooms;
  return out;
}

void cuda_reset_peak_stats(int device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

CudaDeviceMemory cuda_device_memory(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  size_t free = 0, total = 0;
  const cudaError_t rc = cudaMemGetInfo(&free, &total);
  if (rc != cudaSuccess) fail("cudaMemGetInfo failed: {}", cudaGetErrorString(rc));
  return {static_cast<int64_t>(free), static_cast<int64_t>(total)};
}

void cuda_set_memory_fraction(int device, double fraction) {
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device));
}

void cuda_set_allocator_settings(const std::string& settings) { c10::CachingAllocator::setAllocatorSettings(settings); }

void cuda_empty_cache() { c10::cuda::CUDACachingAllocator::emptyCache(); }

std::shared_ptr<void> cuda_allocate_block(int64_t bytes) {
  auto block = std::make_shared<c10::DataPtr>(c10::cuda::CUDACachingAllocator::get()->allocate(static_cast<size_t>(bytes)));
  return {block->get(), [block](void*) mutable { block.reset(); }};
}

void cuda_record_memory_history(bool enabled) {
  if (enabled) {
    torch::cuda::_record_memory_history(std::string("all"), std::string("all"), "all", 100000);
  } else {
    torch::cuda::_record_memory_history(std::nullopt);
  }
}

std::string cuda_memory_snapshot_pickle() { return torch::cuda::_memory_snapshot_pickled(); }

void cuda_record_allocation_origins(bool enabled) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  if (enabled) {
    cuda_set_allocation_origin(-1, 0);  // not left over from a run that ended mid-step
    // STATE: a context for each live block, no history of frees; one trace entry, the least allowed.
    alloc::recordHistory(true, &record_origin, 1, alloc::RecordContext::STATE, false, {});
  } else {
    alloc::recordHistory(false, nullptr, 0, alloc::RecordContext::NEVER, true, {});
  }
}

void cuda_set_allocation_origin(int64_t step, int phase) {
  g_origin_step.store(step, std::memory_order_relaxed);
  g_origin_phase.store(phase, std::memory_order_relaxed);
}

std::vector<CudaLiveBlock> cuda_live_blocks(int device) {
  const auto snapshot = c10::cuda::CUDACachingAllocator::snapshot({0, 0}, /*include_traces=*/false);
  std::vector<CudaLiveBlock> out;
  for (const auto& segment : snapshot.segments) {
    if (segment.device != device) continue;
    for (const auto& block : segment.blocks) {
      if (!block.allocated) continue;
      const auto* origin = dynamic_cast<const AllocationOrigin*>(block.context_when_allocated.get());
      if (origin == nullptr) continue;
      out.push_back({origin->step, origin->phase, static_cast<int64_t>(block.requested_size)});
    }
  }
  return out;
}

namespace {
void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) fail("{} failed: {}", what, cudaGetErrorString(rc));
}
}  // namespace

struct CudaCopyStream::Impl {
  c10::cuda::CUDAStream copies = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream();
  std::vector<cudaEvent_t> marks;  // reused from one step to the next
  size_t used = 0;
  cudaEvent_t next() {
    if (used == marks.size()) {
      cudaEvent_t e = nullptr;
      check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      marks.push_back(e);
    }
    return marks[used++];
  }
};

CudaCopyStream::CudaCopyStream() : impl_(std::make_unique<Impl>()) {}

CudaCopyStream::~CudaCopyStream() {
  for (cudaEvent_t e : impl_->marks) cudaEventDestroy(e);
}

void CudaCopyStream::after_compute() {
  impl_->used = 0;
  impl_->compute = c10::cuda::getCurrentCUDAStream();
  cudaEvent_t e = impl_->next();
  check_cuda(cudaEventRecord(e, impl_->compute.stream()), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(impl_->copies.stream(), e, 0), "cudaStreamWaitEvent");
}

int CudaCopyStream::queue(const std::function<void()>& copies) {
  {
    c10::cuda::CUDAStreamGuard guard(impl_->copies);
    copies();
  }
  const auto mark = static_cast<int>(impl_->used);
  check_cuda(cudaEventRecord(impl_->next(), impl_->copies.stream()), "cudaEventRecord");
  return mark;
}

void CudaCopyStream::wait(int mark) {
  check_cuda(cudaEventSynchronize(impl_->marks[static_cast<size_t>(mark)]), "cudaEventSynchronize");
}

void CudaCopyStream::before_compute() {
  cudaEvent_t e = impl_->next();
  check_cuda(cudaEventRecord(e, impl_->copies.stream()), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(impl_->compute.stream(), e, 0), "cudaStreamWaitEvent");
}

void CudaCopyStream::hold(const at::Tensor& t) { t.record_stream(impl_->copies); }

}  // namespace headroom
