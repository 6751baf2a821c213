// ShardLevel — how a data-parallel run spreads the model's state over its ranks (lever 6). The
// machinery is dist/data_parallel.h; this is the setting, parsed once from --shard.
#pragma once

#include <string>

namespace headroom {

enum class ShardLevel {
  none,       // data parallel: every rank holds everything; gradients averaged after backward
  optimizer,  // ZeRO-1: each rank holds and updates 1/N of the optimizer state
  gradients,  // ZeRO-2: and keeps only its 1/N of the gradients, reduced during backward
  full,       // ZeRO-3 / FSDP: and holds only 1/N of the weights, gathered per layer when used
};

inline constexpr ShardLevel kShardLevels[] = {ShardLevel::none, ShardLevel::optimizer, ShardLevel::gradients,
                                              ShardLevel::full};

const char* shard_level_name(ShardLevel level);
// Throws Error naming the accepted values.
ShardLevel parse_shard_level(const std::string& text);

}  // namespace headroom
