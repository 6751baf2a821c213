// Phase — the part of a training step that is running, as the monitor and the allocator tag it.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace headroom {

enum class Phase : uint8_t { idle, data, forward, backward, optimizer, zero_grad };

inline constexpr std::array<Phase, 5> kStepPhases = {Phase::data, Phase::forward, Phase::backward,
                                                     Phase::optimizer, Phase::zero_grad};

inline std::string_view phase_name(Phase p) {
  switch (p) {
    case Phase::idle: return "idle";
    case Phase::data: return "data";
    case Phase::forward: return "forward";
    case Phase::backward: return "backward";
    case Phase::optimizer: return "optimizer";
    case Phase::zero_grad: return "zero_grad";
  }
  return "?";
}

}  // namespace headroom
