// headroom_cuda_check — run by scripts/gpu-check on a GPU machine: trains a few steps on cuda, then
// prints the CUDA adapter's readings as one JSON object and checks them against each other and
// against NVML. Exit 0: all checks hold; 1: a check failed (listed); 2: no GPU here.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "device/cuda_adapter.h"
#include "device/flash_window_adapter.h"
#include "device/nvml.h"
#include "model/attention.h"
#include "memory/oom_report.h"
#include "train/trainer.h"

using namespace headroom;

namespace {

// The checks' outcome: what failed, and the readings printed.
struct Checks {
  std::vector<std::string> failed;
  nlohmann::json out;
  void check(bool ok, const std::string& what) {
    if (!ok) failed.push_back(what);
  }
};

// A few steps of the small model on cuda, then the allocator's, the device's and NVML's readings,
// checked against each other. Returns the allocator's statistics after the run.
CudaMemoryStats check_training_readings(Checks& c) {
  RunConfig cfg;
  cfg.model = "small";
  cfg.steps = 5;
  cfg.batch = 16;
  cfg.seq = 256;
  cfg.device = "cuda";
  cfg.quiet = true;
  const TrainSummary s = train(cfg).summary;
  const CudaMemoryStats st = cuda_memory_stats(0);
  const CudaDeviceMemory dev = cuda_device_memory(0);
  const NvmlReading nv = nvml_read(0);
  c.out["train"] = {{"peak_bytes", s.peak_bytes}, {"tokens_per_s", s.tokens_per_s}, {"final_loss", s.final_loss}};
  c.out["stats"] = {{"allocated", st.allocated_bytes},
                    {"peak_allocated", st.peak_allocated_bytes},
                    {"reserved", st.reserved_bytes},
                    {"peak_reserved", st.peak_reserved_bytes},
                    {"active", st.active_bytes},
                    {"peak_active", st.peak_active_bytes},
                    {"inactive_split", st.inactive_split_bytes},
                    {"requested", st.requested_bytes},
                    {"peak_requested", st.peak_requested_bytes},
                    {"alloc_retries", st.alloc_retries},
                    {"ooms", st.ooms}};
  c.out["device"] = {{"free", dev.free_bytes}, {"total", dev.total_bytes}};
  c.out["nvml"] = {{"available", nv.available},
                   {"why_not", nv.why_not},
                   {"device_used", nv.device_used_bytes},
                   {"device_total", nv.device_total_bytes},
                   {"process_used", nv.process_used_bytes}};

  c.check(st.allocated_bytes <= st.reserved_bytes, "allocated <= reserved");
  c.check(st.peak_allocated_bytes <= st.peak_reserved_bytes, "peak allocated <= peak reserved");
  c.check(st.allocated_bytes <= st.peak_allocated_bytes, "allocated <= its peak");
  c.check(st.requested_bytes <= st.allocated_bytes, "requested <= allocated (allocated is rounded up)");
  c.check(st.active_bytes >= st.allocated_bytes, "active >= allocated");
  c.check(s.peak_bytes > 0 && s.peak_bytes <= st.peak_allocated_bytes, "train's step peak <= allocator's run peak");
  c.check(dev.total_bytes > 0 && dev.free_bytes <= dev.total_bytes, "cudaMemGetInfo free <= total");
  if (nv.available) {
    c.check(nv.device_total_bytes == dev.total_bytes, "NVML total == cudaMemGetInfo total");
    c.check(nv.device_used_bytes >= st.reserved_bytes, "NVML device used >= reserved");
    if (nv.process_used_bytes >= 0)
      c.check(nv.process_used_bytes >= st.reserved_bytes, "NVML process used >= reserved");
  }
  return st;
}

// Under a memory fraction a large allocation fails as PyTorch's OOM, counted; empty_cache.
void check_out_of_memory(Checks& c, const CudaMemoryStats& st) {
  const CudaDeviceMemory dev = cuda_device_memory(0);
  // A 1 GiB cap: a 2 GiB tensor must fail with PyTorch's OOM, and the count must move.
  cuda_set_memory_fraction(0, static_cast<double>(int64_t{1} << 30) / static_cast<double>(dev.total_bytes));
  bool refused = false;
  try {
    auto big = at::empty({int64_t{1} << 29}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  } catch (const c10::OutOfMemoryError&) {
    refused = true;
  }
  cuda_set_memory_fraction(0, 1.0);
  c.check(refused, "a 2 GiB allocation under a 1 GiB memory fraction is refused");
  c.check(cuda_memory_stats(0).ooms == st.ooms + 1, "the OOM count moved by one");
  const int64_t reserved_before = cuda_memory_stats(0).reserved_bytes;
  cuda_empty_cache();
  c.check(cuda_memory_stats(0).reserved_bytes <= reserved_before, "empty_cache does not grow reserved");
}

// The memory snapshot is a pickle (protocol 2+ starts with 0x80).
void check_snapshot(Checks& c) {
  cuda_record_memory_history(true);
  { auto t = at::ones({1 << 20}, at::TensorOptions().device(at::kCUDA)); }
  const std::string pickle = cuda_memory_snapshot_pickle();
  cuda_record_memory_history(false);
  c.check(!pickle.empty() && static_cast<unsigned char>(pickle[0]) == 0x80, "snapshot is a pickle");
  c.out["snapshot_bytes"] = pickle.size();
}

// Sliding-window attention by FlashAttention's own window: the same output as the masked math
// path, and no seq × seq mask (a 4096-token window costs less than the mask alone would).
void check_windowed_flash(Checks& c) {
  at::manual_seed(0);
  const auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const auto q = at::randn({2, 8, 512, 64}, bf16), k = at::randn({2, 2, 512, 64}, bf16),
             v = at::randn({2, 2, 512, 64}, bf16);
  c.check(windowed_flash_available(q), "windowed flash available for bf16 on cuda");
  const auto flash = causal_attention(q, k, v, AttentionPath::flash, 0.0, 64);
  const auto math = causal_attention(q, k, v, AttentionPath::math, 0.0, 64);
  const double diff = (flash.to(at::kFloat) - math.to(at::kFloat)).abs().max().item<double>();
  c.out["windowed_flash_max_difference"] = diff;
  c.check(diff < 2e-2, "windowed flash equals the masked math path");
  const int64_t t = 4096;
  const auto qq = at::randn({1, 8, t, 64}, bf16).requires_grad_(true);
  const auto kk = at::randn({1, 8, t, 64}, bf16).requires_grad_(true);
  const auto vv = at::randn({1, 8, t, 64}, bf16).requires_grad_(true);
  cuda_synchronize();
  const int64_t before = cuda_memory_stats(0).allocated_bytes;
  cuda_reset_peak_stats(0);
  causal_attention(qq, kk, vv, AttentionPath::flash, 0.0, 1024).sum().backward();
  cuda_synchronize();
  const int64_t peak = cuda_memory_stats(0).peak_allocated_bytes - before;
  c.out["windowed_flash_step_peak_bytes"] = peak;
  c.check(peak < t * t, "windowed flash at 4096 tokens holds no seq x seq mask");
}

}  // namespace

int main() {
  if (!cuda_available()) {
    fmt::print(stderr, "headroom_cuda_check: no CUDA device here\n");
    return 2;
  }
  Checks c;
  const CudaMemoryStats st = check_training_readings(c);
  check_out_of_memory(c, st);
  check_snapshot(c);
  check_windowed_flash(c);
  c.out["failed"] = c.failed;
  fmt::print("{}\n", c.out.dump(2));
  return c.failed.empty() ? 0 : 1;
}
