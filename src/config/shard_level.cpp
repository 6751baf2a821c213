#include "config/shard_level.h"

#include "util/error.h"

namespace headroom {

const char* shard_level_name(ShardLevel level) {
  switch (level) {
    case ShardLevel::none: return "none";
    case ShardLevel::optimizer: return "optimizer";
    case ShardLevel::gradients: return "gradients";
    case ShardLevel::full: return "full";
  }
  return "?";
}

ShardLevel parse_shard_level(const std::string& text) {
  for (ShardLevel s : kShardLevels) {
    if (text == shard_level_name(s)) return s;
  }
  fail("--shard '{}': accepted: none, optimizer, gradients or full", text);
}

}  // namespace headroom
