// What cuBLAS takes from PyTorch's caching allocator at the first matmul on a stream and keeps:
// 4096 KiB x 8 on sm90 and newer (PyTorch's default CUBLAS_WORKSPACE_CONFIG there; cuBLASLt shares
// it; 8.1 MiB on older GPUs). Every cuda estimate counts it once, before the step, in the allocator
// category: the native estimator (step_replay) and the estimate of a traced step (trace_estimate).
#pragma once

#include <cstdint>

namespace headroom {

inline constexpr int64_t kCublasWorkspaceBytes = int64_t{4096} * 1024 * 8;
inline constexpr const char* kCublasWorkspaceFormula =
    "4096 KiB x 8 (sm90+ default of CUBLAS_WORKSPACE_CONFIG), from the caching allocator at the first matmul; "
    "8.1 MiB on older GPUs";

}  // namespace headroom
