// The one adapter over PyTorch's CUDA runtime and semi-private caching-allocator API.
//
// Everything headroom asks of CUDA goes through here, so a PyTorch upgrade touches this file only.
// Compiled on every build (the CUDA toolkit is present even where no GPU is). cuda_available() is
// safe without a GPU; every other function may only be called after it returned true.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace at {
class Tensor;
}  // namespace at

namespace headroom {

bool cuda_available();
int cuda_device_count();
// Initialises PyTorch's CUDA state (the caching allocator among it) if it is not yet: the allocator
// settings below need it, and nothing else may have touched CUDA first. Idempotent.
void cuda_init();
// Makes cuda:`device` the current device of this process (a distributed rank's own card).
void cuda_set_device(int device);
// Waits for all work on cuda:`device` (-1: the current device).
void cuda_synchronize(int device = -1);

// Caching-allocator statistics of one device (all pools), current and peak since the last reset.
struct CudaMemoryStats {
  int64_t allocated_bytes = 0, peak_allocated_bytes = 0;
  int64_t reserved_bytes = 0, peak_reserved_bytes = 0;
  int64_t active_bytes = 0, peak_active_bytes = 0;
  int64_t inactive_split_bytes = 0, peak_inactive_split_bytes = 0;
  int64_t requested_bytes = 0, peak_requested_bytes = 0;
  int64_t alloc_retries = 0;  // cudaMalloc failures that forced a cache flush
  int64_t ooms = 0;
};

CudaMemoryStats cuda_memory_stats(int device);
void cuda_reset_peak_stats(int device);

// Device memory as the driver sees it (cudaMemGetInfo).
struct CudaDeviceMemory {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};
CudaDeviceMemory cuda_device_memory(int device);

// Caps what the caching allocator may reserve to `fraction` of the card (emulates a smaller one).
void cuda_set_memory_fraction(int device, double fraction);
// Applies PYTORCH_CUDA_ALLOC_CONF-style settings, e.g. "expandable_segments:True".
void cuda_set_allocator_settings(const std::string& settings);
// Returns cached, unused blocks to the driver.
void cuda_empty_cache();
// A block of `bytes` from the caching allocator on the current device, returned when the last
// handle goes (for replaying allocation traces through the real allocator).
std::shared_ptr<void> cuda_allocate_block(int64_t bytes);

// PyTorch's memory snapshot (the pickle pytorch.org/memory_viz opens): start recording allocation
// history with stack traces, then take the snapshot.
void cuda_record_memory_history(bool enabled);
std::string cuda_memory_snapshot_pickle();

// Allocation origins, for leak attribution from the allocator's own records: while on, the caching
// allocator tags each allocation with the (step, phase) last set by cuda_set_allocation_origin
// (recordHistory with headroom's context recorder, kept for live blocks only). Exclusive with
// cuda_record_memory_history: the allocator has one recorder; switching either off clears both.
void cuda_record_allocation_origins(bool enabled);
void cuda_set_allocation_origin(int64_t step, int phase);
struct CudaLiveBlock {
  int64_t step = -1;
  int phase = 0;
  int64_t requested_bytes = 0;  // as asked for, before the allocator's rounding
};
// The allocated blocks of `device` that carry an origin.
std::vector<CudaLiveBlock> cuda_live_blocks(int device);

// A stream for copies between pinned host memory and the device beside the compute stream (optimizer
// offload, optim/offload.h; activation offload, model/activation_offload.h): the copies queued on
// it run while the compute stream and the host go on. On the current device; one user at a time.
class CudaCopyStream {
 public:
  CudaCopyStream();
  ~CudaCopyStream();
  CudaCopyStream(const CudaCopyStream&) = delete;
  CudaCopyStream& operator=(const CudaCopyStream&) = delete;
  // Copies queued from now wait for the work the compute stream has queued so far.
  void after_compute();
  // Runs `copies` with this stream current (the non-blocking copies it makes are queued here) and
  // returns a mark of their end.
  int queue(const std::function<void()>& copies);
  // The host waits until the copies before `mark` are done.
  void wait(int mark);
  // The compute stream's later work waits for every copy queued here.
  void before_compute();
  // The caching allocator reuses `t`'s block, once it is freed, only after the copies queued here
  // by then are done (a block the compute stream frees while a copy still reads or writes it).
  void hold(const at::Tensor& t);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace headroom
