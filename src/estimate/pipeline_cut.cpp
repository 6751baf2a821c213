#include "estimate/pipeline_cut.h"

#include <algorithm>
#include <cmath>

#include "dist/pipeline_schedule.h"

namespace headroom {
namespace {

int64_t size(const LayerRange& r) { return r.end - r.first; }


// Fills each value not `known` from the nearest known ones on either side, linearly in the
// stages' micro-batches in flight `k` (the nearer one alone when there is no other, or the two
// hold as many).
void fill_by_in_flight(std::vector<double>& value, const std::vector<bool>& known, const std::vector<int64_t>& k) {
  const auto n = static_cast<int64_t>(value.size());
  for (int64_t s = 0; s < n; ++s) {
    if (known[static_cast<size_t>(s)]) continue;
    int64_t l = s - 1, r = s + 1;
    while (l >= 0 && !known[static_cast<size_t>(l)]) --l;
    while (r < n && !known[static_cast<size_t>(r)]) ++r;
    const auto at = [&](int64_t i) { return static_cast<size_t>(i); };
    if (l >= 0 && r < n && k[at(l)] != k[at(r)]) {
      const double t = static_cast<double>(k[at(s)] - k[at(l)]) / static_cast<double>(k[at(r)] - k[at(l)]);
      value[at(s)] = value[at(l)] + t * (value[at(r)] - value[at(l)]);
    } else {
      value[at(s)] = value[at(l >= 0 && (r >= n || s - l <= r - s) ? l : r)];
    }
  }
}

}  // namespace

CutProposal propose_balanced_cut(const ModelConfig& model, const TrainSpec& spec, StageReplays& replays) {
  const int64_t p = spec.pipeline.stages, layers = model.num_layers;
  const std::vector<LayerRange> start = pipeline_stages(model, spec.pipeline);
  if (!spec.pipeline.split.empty() || p == 1 || p == layers) return {start, start, 0};  // given, or the only cut
  // The step's peak of stage `stage` with the layers cut as `cut`, in live bytes (the reserved
  // replay of a caching allocator is the final estimate's, not the cut's).
  auto stage_peak = [&](const std::vector<LayerRange>& cut, int64_t stage) {
    return replays.live(model, spec, cut, stage).step_peak();
  };
  const std::vector<int64_t> layer_params = stage_parameters(model).layers;
  std::vector<int64_t> prefix(static_cast<size_t>(layers) + 1, 0);
  for (int64_t i = 0; i < layers; ++i) prefix[i + 1] = prefix[i] + layer_params[static_cast<size_t>(i)];
  auto params = [&](int64_t first, int64_t end) { return static_cast<double>(prefix[end] - prefix[first]); };
  const auto stages = static_cast<size_t>(p);
  std::vector<int64_t> in_flight(stages);
  for (size_t s = 0; s < stages; ++s) in_flight[s] = std::min(p - static_cast<int64_t>(s), spec.accum);

  // Each stage's peak at the start. Replayed: the two ends, and the first and last of each run of
  // middle stages holding as many layers; between those a stage differs only in the micro-batches
  // it keeps, and its peak is read off the line through them.
  std::vector<double> peak(stages, 0.0);
  std::vector<bool> replayed(stages, false);
  for (size_t s = 0; s < stages; ++s) {
    const bool end = s == 0 || s + 1 == stages;
    const bool run_first = !end && (s == 1 || size(start[s - 1]) != size(start[s]));
    const bool run_last = !end && (s + 2 == stages || size(start[s + 1]) != size(start[s]));
    if (!end && !run_first && !run_last) continue;
    peak[s] = static_cast<double>(stage_peak(start, static_cast<int64_t>(s)));
    replayed[s] = true;
  }
  fill_by_in_flight(peak, replayed, in_flight);
  int64_t highest = 0;
  for (size_t s = 0; s < stages; ++s) {
    if (replayed[s]) highest = std::max(highest, static_cast<int64_t>(peak[s]));
  }

  // Bytes per parameter of a layer moved onto (or off) a stage: a boundary layer traded with a
  // neighbour that can spare it, at the two ends and the first and last middle stages (a stage
  // whose neighbours hold one layer each trades none); the others' read off the line through them.
  std::vector<double> rate(stages, 0.0);
  std::vector<bool> known(stages, false);
  for (size_t s : {size_t{0}, size_t{1}, stages - 2, stages - 1}) {
    if (s >= stages || known[s]) continue;
    std::vector<LayerRange> cut = start;
    int64_t layer = -1, sign = 1;  // the layer traded, and +1 when stage s gave it away
    if (size(cut[s]) >= 2 && s + 1 < stages) {
      layer = --cut[s].end;
      --cut[s + 1].first;
    } else if (size(cut[s]) >= 2) {
      layer = cut[s].first++;
      ++cut[s - 1].end;
    } else if (s + 1 < stages && size(cut[s + 1]) >= 2) {
      layer = cut[s].end++;
      ++cut[s + 1].first;
      sign = -1;
    } else if (s > 0 && size(cut[s - 1]) >= 2) {
      layer = --cut[s].first;
      --cut[s - 1].end;
      sign = -1;
    } else {
      continue;
    }
    const double here =
        replayed[s] ? peak[s] : static_cast<double>(stage_peak(start, static_cast<int64_t>(s)));
    const double traded = here - static_cast<double>(stage_peak(cut, static_cast<int64_t>(s)));
    rate[s] = static_cast<double>(sign) * traded / params(layer, layer + 1);
    known[s] = true;
  }
  if (std::none_of(known.begin(), known.end(), [](bool k) { return k; })) return {start, start, highest};
  fill_by_in_flight(rate, known, in_flight);

  // Stage s's predicted peak holding layers [first, end): its peak at the start, plus or minus what
  // the layers it gains or loses cost on it.
  const std::vector<LayerRange> cut = lightest_cut(layers, p, [&](int64_t stage, int64_t first, int64_t end) {
    const auto s = static_cast<size_t>(stage);
    return static_cast<int64_t>(
        std::llround(peak[s] + rate[s] * (params(first, end) - params(start[s].first, start[s].end))));
  });
  return {cut, start, highest};
}

std::vector<LayerRange> memory_balanced_cut(const ModelConfig& model, const TrainSpec& given) {
  if (!given.pipeline.split.empty() || given.pipeline.stages == 1) return pipeline_stages(model, given.pipeline);
  TrainSpec spec = given;
  spec.stage = -1;
  spec.every_stage = false;
  return estimate(model, spec).cut;
}

}  // namespace headroom
