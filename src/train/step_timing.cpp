#include "train/step_timing.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>

#include "device/cuda_adapter.h"
#include "device/device.h"
#include "train/trainer.h"
#include "util/interrupt.h"

namespace headroom {

std::optional<double> time_train_step(const RunConfig& base, Precision precision, int64_t rows, int timed) {
  // No guard: the time of this shape, or nothing when it does not fit.
  RunConfig cfg = as_trial(base, 1 + std::max(1, timed));
  cfg.batch = rows;
  cfg.accum = 1;
  cfg.precision = precision;
  cfg.checkpointing = CheckpointPolicy::none();
  cfg.attention = AttentionPath::flash;
  cfg.memory_budget.reset();  // timing only; memory is the estimator's business
  cfg.inject_leak = LeakInjection::none;
  // One process: a data-parallel rank computes the same micro-batch (plan --world-size N costs the
  // collectives apart, and launches nothing).
  cfg.world_size = 0;
  cfg.shard = ShardLevel::none;
  const TrainResult r = train(cfg);
  throw_if_interrupted("while timing steps for the planner");
  if (!r.fits()) return std::nullopt;
  return r.median_step_seconds();
}

double precision_slowdown(Precision precision, const std::string& device_name) {
  if (precision == Precision::fp32) return 1.0;
  static std::map<std::pair<Precision, std::string>, double> known;
  static std::mutex mutex;
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = known.find({precision, device_name}); it != known.end()) return it->second;
  const c10::Device device = resolve_device(device_name);
  const c10::NoGradGuard no_grad;
  auto best_of = [&](at::ScalarType dtype) {
    const auto options = at::TensorOptions().dtype(dtype).device(device);
    const at::Tensor a = at::randn({256, 256}, options), b = at::randn({256, 256}, options);
    double best = 1e9;
    for (int i = 0; i < 4; ++i) {
      if (device.is_cuda()) cuda_synchronize(device.index());
      const auto t0 = std::chrono::steady_clock::now();
      const at::Tensor c = at::mm(a, b);
      if (device.is_cuda()) cuda_synchronize(device.index());
      if (i > 0) best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  const double ratio = best_of(precision == Precision::fp16_mixed ? at::kHalf : at::kBFloat16) / best_of(at::kFloat);
  known[{precision, device_name}] = ratio;
  return ratio;
}

std::optional<double> host_link_bytes_per_second(const std::string& device_name) {
  static std::map<std::string, std::optional<double>> known;
  static std::mutex mutex;
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = known.find(device_name); it != known.end()) return it->second;
  const c10::Device device = resolve_device(device_name);
  constexpr int64_t kBytes = int64_t{64} << 20;
  std::optional<double> speed;
  try {
    const auto bytes = at::TensorOptions().dtype(at::kByte);
    at::Tensor on_device = at::ones({kBytes}, bytes.device(device));
    at::Tensor on_host = at::empty({kBytes}, bytes.pinned_memory(device.is_cuda()));
    auto best_of = [&](at::Tensor& to, const at::Tensor& from) {
      double best = 1e9;
      for (int i = 0; i < 4; ++i) {  // the first warms up
        if (device.is_cuda()) cuda_synchronize(device.index());
        const auto t0 = std::chrono::steady_clock::now();
        to.copy_(from);
        if (device.is_cuda()) cuda_synchronize(device.index());
        if (i > 0) best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      return best;
    };
    const double down = best_of(on_host, on_device), up = best_of(on_device, on_host);
    speed = 2 * static_cast<double>(kBytes) / (down + up);
  } catch (const c10::OutOfMemoryError&) {
    speed = std::nullopt;
  }
  known[device_name] = speed;
  return speed;
}

}  // namespace headroom
