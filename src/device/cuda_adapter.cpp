#include "device/cuda_adapter.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

namespace headroom {

bool cuda_available() { return c10::cuda::device_count() > 0; }

int cuda_device_count() { return c10::cuda::device_count(); }

void cuda_synchronize() { c10::cuda::device_synchronize(); }

CudaMemoryStats cuda_memory_stats(int device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  CudaMemoryStats out;
  out.allocated_bytes = stats.allocated_bytes[kAll].current;
  out.peak_allocated_bytes = stats.allocated_bytes[kAll].peak;
  out.reserved_bytes = stats.reserved_bytes[kAll].current;
  out.peak_reserved_bytes = stats.reserved_bytes[kAll].peak;
  out.alloc_retries = stats.num_alloc_retries;
  out.ooms = stats.num_ooms;
  return out;
}

void cuda_reset_peak_stats(int device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

}  // namespace headroom
