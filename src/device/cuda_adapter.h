// The one adapter over PyTorch's CUDA runtime and semi-private caching-allocator API.
//
// Everything headroom asks of CUDA goes through here, so a PyTorch upgrade touches this file only.
// Compiled on every build (the CUDA toolkit is present even where no GPU is); every function is
// safe to call without a GPU: availability reports false and the rest are only called after it.
#pragma once

#include <cstdint>

namespace headroom {

bool cuda_available();
int cuda_device_count();
void cuda_synchronize();

struct CudaMemoryStats {
  int64_t allocated_bytes = 0;
  int64_t peak_allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t peak_reserved_bytes = 0;
  int64_t alloc_retries = 0;
  int64_t ooms = 0;
};

CudaMemoryStats cuda_memory_stats(int device);
void cuda_reset_peak_stats(int device);

}  // namespace headroom
