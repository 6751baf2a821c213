// Sites — the code that allocated a block, as snapshot_analysis*.cpp name it: for each stack of a
// snapshot (snapshot/memory_snapshot.h), its site, the top user frame (the innermost frame outside
// torch's package and outside C/C++: "train.py:42 in forward"; with none, the first Python frame,
// else the innermost), the next user frames out (its callers), a key of the site's file and line for
// the iteration search, its family (the site with the numbers in its function's name made N, so
// that "step 3 forward" and "step 4 forward" are one), and whether a module's forward or torch.optim
// made it. Looked up lazily, once per stack. Blocks without a stack are "(no stack recorded)";
// kBeforeTraceStack's, "(allocated before the trace began)". group_live() sums live blocks by site.
// Private to the snapshot analysis; not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "snapshot/memory_snapshot.h"
#include "snapshot/snapshot_analysis.h"
#include "snapshot/trace_accounting.h"

namespace headroom::snapshot_analysis {

class Sites {
 public:
  explicit Sites(const MemorySnapshot& s) : s_(s), info_(s.stacks.size()) {}

  struct Info {
    bool done = false;
    int32_t site = 0;
    int32_t family = 0;      // the site with the numbers in its function's name made N: "step N forward"
    uint64_t key = 0;        // file and line of the site (not the function's name, which may number a step)
    int32_t frame = -1;      // index in the stack of the site's frame
    bool forward = false;    // a frame named forward: made while a module ran forward
    bool optimizer = false;  // a frame inside torch/optim
  };

  const Info& info(StackId id);
  std::string label(int32_t site) const;
  // The next user frames out from the site, up to three.
  std::vector<std::string> callers(StackId id);

 private:
  void find_site_frame(Info& i, const std::vector<int32_t>& stack) const;
  void name_site(Info& i, const SnapshotFrame& f);
  int32_t site_id(const std::string& label);

  const MemorySnapshot& s_;
  std::vector<Info> info_;
  std::vector<std::string> labels_;
  std::unordered_map<std::string, int32_t> ids_;
};

// The live blocks (those `keep` accepts; all without it) summed by site, largest first (ties by
// site), at most `top`; each group's callers are those of its largest block.
std::vector<SiteGroup> group_live(const LiveMap& live, Sites& sites, int64_t top,
                                  const std::function<bool(const LiveBlock&)>& keep = nullptr);

}  // namespace headroom::snapshot_analysis
