#include "config/pipeline_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "util/error.h"

namespace headroom {
namespace {
constexpr const char* kSplitForm = "accepted: contiguous ranges of layers from 0, such as 0:12,12:24";

int64_t layer_number(const std::string& text, const std::string& whole) {
  if (text.empty() || text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos) {
    fail("--pipeline-split '{}': '{}' is not a layer number; {}", whole, text, kSplitForm);
  }
  return std::stoll(text);
}
}  // namespace

std::vector<LayerRange> parse_pipeline_split(const std::string& text) {
  std::vector<LayerRange> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(begin, end - begin);
    const size_t colon = item.find(':');
    if (colon == std::string::npos) fail("--pipeline-split '{}': '{}' is not FIRST:END; {}", text, item, kSplitForm);
    const LayerRange r{layer_number(item.substr(0, colon), text), layer_number(item.substr(colon + 1), text)};
    if (r.end <= r.first) fail("--pipeline-split '{}': {} holds no layer; {}", text, item, kSplitForm);
    const int64_t expected = out.empty() ? 0 : out.back().end;
    if (r.first != expected) {
      fail("--pipeline-split '{}': {} should start at layer {} (the ranges must be contiguous from 0); {}", text, item,
           expected, kSplitForm);
    }
    out.push_back(r);
    begin = end + 1;
  }
  return out;
}

std::string pipeline_split_text(const std::vector<LayerRange>& split) {
  std::string out;
  for (const LayerRange& r : split) out += fmt::format("{}{}:{}", out.empty() ? "" : ",", r.first, r.end);
  return out;
}

std::vector<LayerRange> stage_ranges(const PipelineLayout& layout, const std::vector<int64_t>& layer_params,
                                     int64_t embed_params, int64_t head_params) {
  const auto layers = static_cast<int64_t>(layer_params.size());
  const int64_t p = layout.stages;
  if (p < 1) fail("--pipeline must be 1 or more, got {}", p);
  if (!layout.split.empty()) {
    if (static_cast<int64_t>(layout.split.size()) != p) {
      fail("--pipeline-split '{}' has {} stages and --pipeline is {}; accepted: one range per stage",
           pipeline_split_text(layout.split), layout.split.size(), p);
    }
    if (layout.split.back().end != layers) {
      fail("--pipeline-split '{}' ends at layer {}, and the model has {} layers; accepted: ranges covering 0:{}",
           pipeline_split_text(layout.split), layout.split.back().end, layers, layers);
    }
    return layout.split;
  }
  if (p > layers) {
    fail("--pipeline {}: the model has {} layers, and every stage needs one; accepted: --pipeline 1 to {}", p, layers,
         layers);
  }
  // prefix[i]: the parameters of layers [0, i).
  std::vector<int64_t> prefix(static_cast<size_t>(layers) + 1, 0);
  for (int64_t i = 0; i < layers; ++i) prefix[i + 1] = prefix[i] + layer_params[static_cast<size_t>(i)];
  return lightest_cut(layers, p, [&](int64_t stage, int64_t first, int64_t end) {
    return prefix[end] - prefix[first] + (stage == 0 ? embed_params : 0) + (stage == p - 1 ? head_params : 0);
  });
}

std::vector<LayerRange> lightest_cut(int64_t layers, int64_t p,
                                     const std::function<int64_t(int64_t stage, int64_t first, int64_t end)>& weight) {
  // best[s][i]: the lightest heaviest stage when layers [0, i) make stages 0..s-1 (s stages).
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(static_cast<size_t>(p) + 1,
                                         std::vector<int64_t>(static_cast<size_t>(layers) + 1, kNone));
  best[0][0] = 0;
  for (int64_t s = 1; s <= p; ++s) {
    for (int64_t i = s; i <= layers; ++i) {
      for (int64_t j = s - 1; j < i; ++j) {
        if (best[s - 1][j] == kNone) continue;
        best[s][i] = std::min(best[s][i], std::max(best[s - 1][j], weight(s - 1, j, i)));
      }
    }
  }
  // Among the cuts within the optimum, the most even (the smallest sum of squared stage sizes), so
  // that no stage is left nearly empty; of equally even ones, the one whose earlier stages, which
  // keep more micro-batches in flight, hold fewer layers.
  const int64_t optimum = best[p][layers];
  constexpr double kNoCut = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> even(static_cast<size_t>(p) + 1,
                                        std::vector<double>(static_cast<size_t>(layers) + 1, kNoCut));
  std::vector<std::vector<int64_t>> from(even.size(), std::vector<int64_t>(static_cast<size_t>(layers) + 1, -1));
  even[0][0] = 0;
  for (int64_t s = 1; s <= p; ++s) {
    for (int64_t i = s; i <= layers; ++i) {
      // On a tie the earliest split point stays: this stage takes more layers, the earlier ones fewer.
      for (int64_t j = s - 1; j < i; ++j) {
        const int64_t w = weight(s - 1, j, i);
        if (even[s - 1][j] == kNoCut || w > optimum) continue;
        const double cost = even[s - 1][j] + static_cast<double>(w) * static_cast<double>(w);
        if (cost < even[s][i]) {
          even[s][i] = cost;
          from[s][i] = j;
        }
      }
    }
  }
  std::vector<LayerRange> out(static_cast<size_t>(p));
  int64_t end = layers;
  for (int64_t s = p; s >= 1; --s) {
    const int64_t first = from[s][end];
    out[static_cast<size_t>(s - 1)] = {first, end};
    end = first;
  }
  return out;
}

std::vector<LayerRange> even_cut(int64_t layers, int64_t stages) {
  if (stages < 1 || stages > layers) fail("even_cut: {} stages of {} layers; accepted: 1 to {}", stages, layers, layers);
  std::vector<int64_t> size(static_cast<size_t>(stages), layers / stages);
  // Who takes the layers left over: stages P-2 down to 1, then P-1, then 0.
  std::vector<int64_t> takers;
  for (int64_t s = stages - 2; s >= 1; --s) takers.push_back(s);
  if (stages > 1) takers.push_back(stages - 1);
  takers.push_back(0);
  for (int64_t k = 0; k < layers % stages; ++k) ++size[static_cast<size_t>(takers[static_cast<size_t>(k)])];
  std::vector<LayerRange> out;
  int64_t first = 0;
  for (int64_t n : size) {
    out.push_back({first, first + n});
    first += n;
  }
  return out;
}

}  // namespace headroom
