#include "snapshot/sites.h"

#include <fmt/format.h>

#include <algorithm>
#include <string_view>

namespace headroom::snapshot_analysis {
namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// A frame of the user's own code: Python (or a headroom step) outside torch's package, not C/C++.
bool is_user_frame(const SnapshotFrame& f) {
  const std::string_view n = f.filename;
  if (n.empty() || n == "??" || n.front() == '<') return false;
  for (const char* ext : {".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".cu", ".cuh"}) {
    if (ends_with(n, ext)) return false;
  }
  return n.find("/torch/") == std::string_view::npos && n.rfind("torch/", 0) != 0;
}

std::string frame_label(const SnapshotFrame& f) {
  return f.name.empty() ? fmt::format("{}:{}", f.filename, f.line)
                        : fmt::format("{}:{} in {}", f.filename, f.line, f.name);
}

// The function's name with each run of digits made one N: "step3_forward" -> "stepN_forward".
std::string numbers_as_n(const std::string& name) {
  std::string out;
  for (size_t k = 0; k < name.size(); ++k) {
    const bool digit = name[k] >= '0' && name[k] <= '9';
    if (!digit)
      out += name[k];
    else if (k == 0 || name[k - 1] < '0' || name[k - 1] > '9')
      out += 'N';
  }
  return out;
}

constexpr const char* kNoStackLabel = "(no stack recorded)";
constexpr const char* kBeforeTrace = "(allocated before the trace began)";
constexpr uint64_t kNoSiteKey = 0x9e3779b97f4a7c15ull;

}  // namespace

const Sites::Info& Sites::info(StackId id) {
  if (id == kBeforeTraceStack) {
    static const Info before{true, -2, -2, 0x7f4a7c159e3779b9ull, -1, false, false};
    return before;
  }
  if (id == kNoStack || id < 0 || static_cast<size_t>(id) >= info_.size()) {
    static const Info none{true, -1, -1, kNoSiteKey, -1, false, false};
    return none;
  }
  Info& i = info_[id];
  if (i.done) return i;
  i.done = true;
  const auto& stack = s_.stacks[id];
  find_site_frame(i, stack);
  if (i.frame < 0) {
    i.site = i.family = -1;
    i.key = kNoSiteKey;
    return i;
  }
  name_site(i, s_.frames[stack[i.frame]]);
  return i;
}

// The frames' flags, and the site's frame: the first user frame; with none, the first Python
// frame, else the innermost (none for an empty stack).
void Sites::find_site_frame(Info& i, const std::vector<int32_t>& stack) const {
  for (size_t k = 0; k < stack.size(); ++k) {
    const SnapshotFrame& f = s_.frames[stack[k]];
    if (f.name == "forward") i.forward = true;
    if (f.filename.find("torch/optim/") != std::string::npos) i.optimizer = true;
    if (i.frame < 0 && is_user_frame(f)) i.frame = static_cast<int32_t>(k);
  }
  if (i.frame < 0) {  // none of the user's: the first Python frame, else the innermost
    for (size_t k = 0; k < stack.size() && i.frame < 0; ++k) {
      if (ends_with(s_.frames[stack[k]].filename, ".py")) i.frame = static_cast<int32_t>(k);
    }
    if (i.frame < 0 && !stack.empty()) i.frame = 0;
  }
}

void Sites::name_site(Info& i, const SnapshotFrame& f) {
  i.site = site_id(frame_label(f));
  SnapshotFrame numbered = f;
  numbered.name = numbers_as_n(f.name);
  i.family = site_id(frame_label(numbered));
  i.key = std::hash<std::string>{}(f.filename) * 1000003u ^ static_cast<uint64_t>(f.line);
}

std::string Sites::label(int32_t site) const {
  return site == -2 ? kBeforeTrace : site < 0 ? kNoStackLabel : labels_[site];
}

std::vector<std::string> Sites::callers(StackId id) {
  std::vector<std::string> out;
  const Info& i = info(id);
  if (i.frame < 0) return out;
  const auto& stack = s_.stacks[id];
  for (size_t k = i.frame + 1; k < stack.size() && out.size() < 3; ++k) {
    if (is_user_frame(s_.frames[stack[k]])) out.push_back(frame_label(s_.frames[stack[k]]));
  }
  return out;
}

int32_t Sites::site_id(const std::string& label) {
  auto [it, inserted] = ids_.try_emplace(label, static_cast<int32_t>(labels_.size()));
  if (inserted) labels_.push_back(label);
  return it->second;
}

std::vector<SiteGroup> group_live(const LiveMap& live, Sites& sites, int64_t top,
                                  const std::function<bool(const LiveBlock&)>& keep) {
  struct Acc {
    int64_t bytes = 0, count = 0, largest = -1;
    StackId largest_stack = kNoStack;
  };
  std::unordered_map<int32_t, Acc> by_site;
  for (const auto& [addr, b] : live) {
    if (keep && !keep(b)) continue;
    Acc& a = by_site[sites.info(b.stack).site];
    a.bytes += b.size;
    ++a.count;
    if (b.size > a.largest) a.largest = b.size, a.largest_stack = b.stack;
  }
  std::vector<SiteGroup> out;
  for (const auto& [site, a] : by_site) {
    out.push_back({sites.label(site), sites.callers(a.largest_stack), a.bytes, a.count});
  }
  std::sort(out.begin(), out.end(), [](const SiteGroup& x, const SiteGroup& y) {
    return x.bytes != y.bytes ? x.bytes > y.bytes : x.site < y.site;
  });
  if (static_cast<int64_t>(out.size()) > top) out.resize(top);
  return out;
}

}  // namespace headroom::snapshot_analysis
