// The one adapter over PyTorch's pickler (torch/csrc/jit/serialization), which writes the pickles
// PyTorch's own memory snapshots are: plain protocol-2 dicts, lists, strings, ints, floats and bools
// that Python's pickle.load and pytorch.org/memory_viz read without torch.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace headroom {

// `value` as a pickle: objects as dicts with string keys, arrays as lists, null as None.
std::string pickle_value(const nlohmann::json& value);

}  // namespace headroom
