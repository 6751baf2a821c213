// JSON output that cannot throw on odd text: invalid UTF-8 (a file name, a --set value) is replaced,
// not an exception in the middle of reporting an error.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace headroom {

inline std::string dump_json(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace headroom
