// The one adapter over ATen's autocast internals (ATen/autocast_mode.h) and the random-number
// generators' state: what mixed precision and activation checkpointing need to capture and restore.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <optional>

namespace headroom {

struct AutocastState {
  bool enabled = false;
  c10::ScalarType dtype = c10::ScalarType::BFloat16;
};

AutocastState autocast_state(c10::DeviceType device);

// Sets autocast for `device` to `state` for its lifetime, then restores the previous state. The
// outermost enabled scope clears autocast's cache of low-precision weight copies when it closes,
// so the copies made in a forward pass do not outlive it.
class AutocastScope {
 public:
  AutocastScope(c10::DeviceType device, AutocastState state);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  c10::DeviceType device_;
  AutocastState previous_;
  bool nested_ = false;
};

// `t` as an autocast-listed operator (a matmul) on `device` would take it: a low-precision copy
// (autocast's cached one, for a weight that requires grad) while autocast is on and `t` is float32;
// `t` itself otherwise.
at::Tensor autocast_input(const at::Tensor& t, c10::DeviceType device);

// The default generator's state for `device` (cpu, or a cuda device), and its restoration.
at::Tensor rng_state(const c10::Device& device);
void set_rng_state(const c10::Device& device, const at::Tensor& state);

}  // namespace headroom
