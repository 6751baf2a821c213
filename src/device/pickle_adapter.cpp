#include "device/pickle_adapter.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/serialization/pickler.h>

namespace headroom {
namespace {

c10::IValue to_ivalue(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::object: {
      // Any-typed, as PyTorch's memory_snapshot.cpp builds them: pickled as a plain dict.
      c10::Dict<c10::IValue, c10::IValue> d(c10::AnyType::get(), c10::AnyType::get());
      for (const auto& [key, item] : v.items()) d.insert(c10::IValue(key), to_ivalue(item));
      return d;
    }
    case nlohmann::json::value_t::array: {
      c10::List<c10::IValue> l(c10::AnyType::get());
      for (const auto& item : v) l.push_back(to_ivalue(item));
      return l;
    }
    case nlohmann::json::value_t::string: return c10::IValue(v.get<std::string>());
    case nlohmann::json::value_t::boolean: return c10::IValue(v.get<bool>());
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return c10::IValue(v.get<int64_t>());
    case nlohmann::json::value_t::number_float: return c10::IValue(v.get<double>());
    default: return c10::IValue();
  }
}

}  // namespace

std::string pickle_value(const nlohmann::json& value) {
  std::string out;
  // No type tags on dicts and lists (tag_aggregates false), as memory_snapshot.cpp pickles: readers
  // without torch see plain Python objects.
  torch::jit::Pickler pickler([&](const char* data, size_t size) { out.append(data, size); }, nullptr, nullptr,
                              nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(to_ivalue(value));
  pickler.stop();
  return out;
}

}  // namespace headroom
