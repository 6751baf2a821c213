// AllocationTag — what memory allocated for a while is, when neither its phase nor the tensors the
// monitor tracks can tell: a collective's buffers, or weights gathered from the ranks' slices
// (dist/data_parallel.h), which are let go before the phase ends. The code that allocates them
// says so (MemoryProbe::set_tag); the allocator counts their live bytes apart, and at its peak.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace headroom {

enum class AllocationTag : uint8_t { none, communication, gathered_weights };

// Live bytes per tag (none's entry unused).
struct TaggedBytes {
  std::array<int64_t, 3> bytes{};
  int64_t operator[](AllocationTag t) const { return bytes[static_cast<size_t>(t)]; }
  int64_t& operator[](AllocationTag t) { return bytes[static_cast<size_t>(t)]; }
};

}  // namespace headroom
