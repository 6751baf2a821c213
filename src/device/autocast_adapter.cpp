#include "device/autocast_adapter.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>

namespace headroom {

AutocastState autocast_state(c10::DeviceType device) {
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
}

AutocastScope::AutocastScope(c10::DeviceType device, AutocastState state)
    : device_(device), previous_(autocast_state(device)) {
  at::autocast::set_autocast_enabled(device_, state.enabled);
  at::autocast::set_autocast_dtype(device_, state.dtype);
  if (state.enabled) {
    at::autocast::increment_nesting();
    nested_ = true;
  }
}

AutocastScope::~AutocastScope() {
  if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, previous_.enabled);
  at::autocast::set_autocast_dtype(device_, previous_.dtype);
}

at::Tensor autocast_input(const at::Tensor& t, c10::DeviceType device) {
  if (!at::autocast::is_autocast_enabled(device) || t.scalar_type() != at::kFloat) return t;
  return at::autocast::cached_cast(at::autocast::get_autocast_dtype(device), t, device);
}

namespace {
at::Generator generator_for(const c10::Device& device) {
  if (device.is_cuda()) return at::cuda::detail::getDefaultCUDAGenerator(device.has_index() ? device.index() : 0);
  return at::detail::getDefaultCPUGenerator();
}
}  // namespace

at::Tensor rng_state(const c10::Device& device) {
  at::Generator gen = generator_for(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const c10::Device& device, const at::Tensor& state) {
  at::Generator gen = generator_for(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace headroom
