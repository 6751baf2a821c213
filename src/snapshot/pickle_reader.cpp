#include "snapshot/pickle_reader.h"

#include <fmt/format.h>

namespace headroom {

PickleError::PickleError(uint64_t offset, const std::string& detail, const std::string& name)
    : Error(name.empty() ? fmt::format("pickle offset {}: {}", offset, detail)
                         : fmt::format("{}: pickle offset {}: {}", name, offset, detail)),
      offset_(offset),
      detail_(detail) {}

PickleDocument::Kind PickleDocument::kind(Ref r) const {
  switch (tag(r)) {
    case kSmallInt:
    case kWideInt: return Kind::integer;
    case kConstant: return index(r) == 0 ? Kind::none : Kind::boolean;
    case kFloat: return Kind::floating;
    case kString: return Kind::string;
    case kBytes: return Kind::bytes;
    case kContainer: return containers_[index(r)].kind;
    default: return Kind::none;
  }
}

std::optional<int64_t> PickleDocument::integer(Ref r) const {
  switch (tag(r)) {
    case kSmallInt: {
      // 61 bits stored; sign-extend.
      const uint64_t v = index(r);
      return static_cast<int64_t>(v << 3) >> 3;
    }
    case kWideInt: return wide_ints_[index(r)];
    case kConstant:
      if (index(r) == 0) return std::nullopt;
      return index(r) == 2 ? 1 : 0;
    default: return std::nullopt;
  }
}

std::optional<double> PickleDocument::number(Ref r) const {
  if (tag(r) == kFloat) return floats_[index(r)];
  if (const auto i = integer(r)) return static_cast<double>(*i);
  return std::nullopt;
}

std::optional<std::string_view> PickleDocument::text(Ref r) const {
  if (tag(r) != kString && tag(r) != kBytes) return std::nullopt;
  const Span& s = spans_[index(r)];
  return std::string_view(arena_[s.block].get() + s.offset, s.length);
}

uint64_t PickleDocument::size(Ref r) const {
  if (tag(r) != kContainer) return 0;
  const Container& c = container(r);
  return c.kind == Kind::dict ? c.size / 2 : c.size;
}

std::optional<PickleDocument::Ref> PickleDocument::get(Ref dict, std::string_view key) const {
  std::optional<Ref> found;
  for_each_item(dict, [&](Ref k, Ref v) {
    if (const auto t = text(k); t && tag(k) == kString && *t == key) found = v;
    return true;
  });
  return found;
}

uint64_t PickleDocument::memory_bytes() const {
  uint64_t arena = 0;
  for (uint64_t s : arena_sizes_) arena += s;
  return arena + wide_ints_.size() * 8 + floats_.size() * 8 + spans_.size() * sizeof(Span) +
         containers_.size() * sizeof(Container) + runs_.size() * sizeof(Run) + refs_.size() * sizeof(Ref);
}

}  // namespace headroom
