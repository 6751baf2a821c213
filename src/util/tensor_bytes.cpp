#include "util/tensor_bytes.h"

#include <unordered_set>

namespace headroom {

int64_t storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const auto& s = t.storage();
    if (seen.insert(s.unsafeGetStorageImpl()).second) bytes += static_cast<int64_t>(s.nbytes());
  }
  return bytes;
}

}  // namespace headroom
