#include "device/cuda_graph.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

#include "util/error.h"
#include "util/files.h"

namespace headroom {
namespace {

std::string reason(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return first_line(c10_error != nullptr ? c10_error->what_without_backtrace() : e.what());
}

// While alive, an operation that would synchronize with the host (.item(), a copy from pageable
// memory) throws on the host instead. During the warm-up that finds it before any capture starts;
// during the capture it throws before CUDA sees the illegal call, so the capture can still be ended
// cleanly rather than invalidated.
class HostSyncIsAnError {
 public:
  HostSyncIsAnError() : previous_(c10::cuda::warning_state().get_sync_debug_mode()) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  }
  ~HostSyncIsAnError() { c10::cuda::warning_state().set_sync_debug_mode(previous_); }
  HostSyncIsAnError(const HostSyncIsAnError&) = delete;
  HostSyncIsAnError& operator=(const HostSyncIsAnError&) = delete;

 private:
  c10::cuda::SyncDebugMode previous_;
};

}  // namespace

struct CudaGraph::Impl {
  std::optional<at::cuda::CUDAGraph> graph;
};

CudaGraph::CudaGraph() : impl_(std::make_unique<Impl>()) {}
CudaGraph::~CudaGraph() = default;

void CudaGraph::capture(int device, const std::function<void()>& work) {
  if (captured_) fail("CudaGraph::capture: already captured");
  const auto index = static_cast<c10::DeviceIndex>(device);
  const c10::cuda::CUDAGuard on_device(index);
  // Capture cannot run on the legacy default stream; the side stream starts after everything before.
  c10::cuda::device_synchronize();
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
  try {
    const c10::cuda::CUDAStreamGuard on_side(side);
    const HostSyncIsAnError strict;
    work();
  } catch (const std::exception& e) {
    fail("the step cannot be captured as a CUDA graph: {}", reason(e));
  }
  c10::cuda::device_synchronize();
  const auto pool = at::cuda::graph_pool_handle();
  impl_->graph.emplace();
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    impl_->graph->capture_begin(pool);
    std::string failure;
    try {
      const HostSyncIsAnError strict;
      work();
    } catch (const std::exception& e) {
      failure = reason(e);
    }
    try {
      impl_->graph->capture_end();
    } catch (const std::exception& e) {
      // CUDA invalidated the capture: capture_end() stopped before handing the allocator back its
      // routing to the private pool; do that here so that later allocations are ordinary again.
      if (failure.empty()) failure = reason(e);
      try {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(index, pool);
        c10::cuda::CUDACachingAllocator::releasePool(index, pool);
      } catch (const std::exception&) {
      }
    }
    if (!failure.empty()) {
      impl_->graph.reset();
      fail("the step cannot be captured as a CUDA graph: {}", failure);
    }
  }
  c10::cuda::device_synchronize();
  captured_ = true;
}

void CudaGraph::replay() {
  if (!captured_) fail("CudaGraph::replay: nothing captured");
  impl_->graph->replay();
}

}  // namespace headroom
