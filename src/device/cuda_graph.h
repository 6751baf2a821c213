// The one adapter over PyTorch's CUDA graphs (ATen/cuda/CUDAGraph.h): capture the kernels some work
// launches, then launch them all again with one call.
//
// Compiled on every build; only usable where cuda_available(). Replay runs the captured kernels on
// the same memory: inputs are fed by copying into the tensors the work read during capture, and
// results are read from the tensors it wrote, which live in the graph's private memory pool for as
// long as the graph does. Work that synchronizes with the host (.item(), a pageable host-to-device
// copy) or changes shape cannot be captured.
#pragma once

#include <functional>
#include <memory>

namespace headroom {

class CudaGraph {
 public:
  CudaGraph();
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Runs `work` once on a side stream of cuda:`device` (lazy initialisation happens outside the
  // capture), waits, then runs it again while capturing. A host synchronisation inside `work` is an
  // error in both runs. Throws Error naming the reason when the capture fails; this graph stays
  // empty and the device usable (a failure CUDA detects itself may leave the random-number
  // generator's capture state behind: treat the process as done with capturing).
  void capture(int device, const std::function<void()>& work);
  // Launches the captured kernels on the current stream. Requires a successful capture().
  void replay();
  bool captured() const { return captured_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool captured_ = false;
};

}  // namespace headroom
