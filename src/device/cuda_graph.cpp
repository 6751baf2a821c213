#include "device/cuda_graph.h"

#include <ATen/cuda/CUDAGraph.h>
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

}  // namespace

struct CudaGraph::Impl {
  std::optional<at::cuda::CUDAGraph> graph;
};

CudaGraph::CudaGraph() : impl_(std::make_unique<Impl>()) {}
CudaGraph::~CudaGraph() = default;

void CudaGraph::capture(const std::function<void()>& work) {
  if (captured_) fail("CudaGraph::capture: already captured");
  // Capture cannot run on the legacy default stream; the side stream starts after everything before.
  c10::cuda::device_synchronize();
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    work();
  }
  c10::cuda::device_synchronize();
  impl_->graph.emplace();
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    impl_->graph->capture_begin();
    try {
      work();
    } catch (const std::exception& e) {
      // End the capture so that the stream and the allocator's routing to the private pool are
      // released; its own failure (an invalidated capture) says nothing new.
      try {
        impl_->graph->capture_end();
      } catch (const std::exception&) {
      }
      impl_->graph.reset();
      fail("the step cannot be captured as a CUDA graph: {}", reason(e));
    }
    try {
      impl_->graph->capture_end();
    } catch (const std::exception& e) {
      impl_->graph.reset();
      fail("the step cannot be captured as a CUDA graph: {}", reason(e));
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
