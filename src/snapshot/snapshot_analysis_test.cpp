// `headroom analyze` on snapshots with known contents:
//   - written by tools/snapshot_gen.py (Python's pickle, the documented keys and event kinds), each
//     with something planted — a training loop, a leak of 4 MiB an iteration at train.py:77, a
//     fragmentation case laid out by hand, an OOM — and the figures the script computed itself;
//   - written by headroom's own cpu caching allocator (train --memory-snapshot), checked against the
//     same run's metrics: the round trip;
//   - and bad input through the CLI: exit 2 and one line.
#include "snapshot/snapshot_analysis.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <string>

#include "snapshot/analysis_html.h"
#include "snapshot/memory_snapshot.h"
#include "testing/command.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"

namespace headroom {
namespace {

using testing::read_jsonl;
using testing::run_command;
using testing::TempDir;
constexpr int64_t MiB = int64_t{1} << 20;

struct Generated {
  nlohmann::json facts;
  SnapshotAnalysis analysis;
  std::string path;
};

Generated generate(const TempDir& dir, const std::string& scenario) {
  Generated g;
  g.path = dir.file(scenario + ".pickle");
  const auto r = run_command(std::string(HEADROOM_PYTHON) + " " + HEADROOM_SOURCE_DIR + "/tools/snapshot_gen.py " +
                             scenario + " " + g.path);
  EXPECT_EQ(r.code, 0) << r.out;
  g.facts = nlohmann::json::parse(r.out);
  g.analysis = analyze_snapshot(read_memory_snapshot(g.path), g.path);
  // Read as a whole document first, the snapshot is the same as when its trace streams.
  EXPECT_EQ(analyze_snapshot(memory_snapshot_from(read_pickle_file(g.path), g.path), g.path).to_json(),
            g.analysis.to_json());
  return g;
}

int64_t group_bytes(const std::vector<SiteGroup>& groups, const std::string& site) {
  for (const SiteGroup& g : groups) {
    if (g.site == site) return g.bytes;
  }
  return -1;
}

TEST(SnapshotAnalysis, ATrainingLoopItsPeaksWhatWasLiveAndItsIterations) {
  TempDir dir;
  const Generated g = generate(dir, "training");
  ASSERT_EQ(g.analysis.devices.size(), 1u);
  const DeviceAnalysis& d = g.analysis.devices[0];
  EXPECT_EQ(d.events, g.facts["events"].get<int64_t>());
  EXPECT_EQ(d.peak_allocated, g.facts["peak_allocated"].get<int64_t>());
  EXPECT_EQ(d.peak_reserved, g.facts["peak_reserved"].get<int64_t>());
  EXPECT_EQ(d.allocated_at_start, 0);
  EXPECT_EQ(d.reserved_at_start, 0);
  // Every site the script says was live at the peak, with its bytes; the largest first.
  for (const auto& [site, bytes] : g.facts["live_at_peak"].items()) {
    EXPECT_EQ(group_bytes(d.live_at_peak, site), bytes.get<int64_t>()) << site;
  }
  EXPECT_TRUE(std::is_sorted(d.live_at_peak.begin(), d.live_at_peak.end(),
                             [](const SiteGroup& a, const SiteGroup& b) { return a.bytes > b.bytes; }));
  // The activations name the layer's line and, as callers, the model's and the loop's.
  const auto act = std::find_if(d.live_at_peak.begin(), d.live_at_peak.end(),
                                [](const SiteGroup& s) { return s.site == "model.py:42 in forward"; });
  ASSERT_NE(act, d.live_at_peak.end());
  EXPECT_EQ(act->callers, (std::vector<std::string>{"model.py:90 in forward", "train.py:51 in step"}));
  ASSERT_TRUE(d.iterations_found) << d.iterations_reason;
  EXPECT_EQ(static_cast<int64_t>(d.iterations.size()), g.facts["iterations"].get<int64_t>());
  EXPECT_FALSE(d.leak.detected) << d.leak.reason;
  EXPECT_TRUE(d.ooms.empty());
  EXPECT_LE(d.timeline.size(), 400u);
  // The documented event kinds, each read as its own action; the cache emptied at the end.
  const MemorySnapshot snap = read_memory_snapshot(g.path);
  std::set<std::string> actions;
  for (const SnapshotEvent& e : snap.traces.at(0)) actions.insert(snapshot_action_name(e.action));
  EXPECT_EQ(actions, (std::set<std::string>{"alloc", "free_requested", "free_completed", "segment_alloc",
                                            "segment_free", "snapshot"}));
  ASSERT_GT(g.facts["emptied"].get<int64_t>(), 0);
  EXPECT_EQ(d.reserved_at_end, d.peak_reserved - g.facts["emptied"].get<int64_t>());
}

TEST(SnapshotAnalysis, APlantedLeakIsFoundWithItsSiteAndRate) {
  TempDir dir;
  const Generated g = generate(dir, "leak");
  const DeviceAnalysis& d = g.analysis.devices.at(0);
  ASSERT_TRUE(d.iterations_found) << d.iterations_reason;
  EXPECT_EQ(static_cast<int64_t>(d.iterations.size()), g.facts["iterations"].get<int64_t>());
  ASSERT_TRUE(d.leak.detected) << d.leak.reason;
  EXPECT_EQ(d.leak.bytes_per_step, static_cast<double>(g.facts["leak_bytes_per_iteration"].get<int64_t>()));
  ASSERT_FALSE(d.leak.sites.empty());
  EXPECT_EQ(d.leak.sites[0].origin, g.facts["leak_site"].get<std::string>());
  EXPECT_EQ(d.leak.sites[0].bytes, 4 * MiB);
  // Made in iterations 2..7 (the first is warm-up; the last may be in flight).
  EXPECT_EQ(d.leak.sites[0].count, g.facts["iterations"].get<int64_t>() - 2);
  EXPECT_EQ(d.leak.sites.size(), 1u) << "only the planted site";
}

TEST(SnapshotAnalysis, FragmentationAtThePeakAndTheReplays) {
  TempDir dir;
  const Generated g = generate(dir, "fragmentation");
  const DeviceAnalysis& d = g.analysis.devices.at(0);
  // Hand-computed in the script: 8 segments of 20 MiB, each with one live 6 MiB block.
  EXPECT_EQ(d.peak_allocated, g.facts["hand_peak_allocated"].get<int64_t>());
  EXPECT_EQ(d.peak_reserved, g.facts["hand_peak_reserved"].get<int64_t>());
  EXPECT_EQ(d.inactive_split_at_peak, g.facts["inactive_split"].get<int64_t>());
  EXPECT_EQ(d.free_segments_at_peak, g.facts["free_segments_at_peak"].get<int64_t>());
  EXPECT_EQ(d.empty_cache_at_end, g.facts["empty_cache_now"].get<int64_t>());
  ASSERT_EQ(d.fragmented_segments.size(), 8u);
  for (const SegmentState& s : d.fragmented_segments) {
    EXPECT_EQ(s.total, 20 * MiB);
    EXPECT_EQ(s.inactive_split, 14 * MiB);
  }
  // PyTorch's policy cuts the same segments (best fit: three 6 MiB blocks in each 20 MiB segment;
  // no 14 MiB hole serves 16 MiB): the replay as recorded reaches the recorded peak exactly.
  ASSERT_GE(d.replays.size(), 2u);
  EXPECT_EQ(d.replays[0].peak_reserved, d.peak_reserved);
  EXPECT_EQ(d.replays[1].setting, "expandable_segments:True");
  EXPECT_GT(d.replays[1].saving, 0);
  EXPECT_NE(d.fragmentation.find("saves"), std::string::npos) << d.fragmentation;
}

TEST(SnapshotAnalysis, AnOomItsRequestWhatWasLiveAndCachedAndTheLevers) {
  TempDir dir;
  const Generated g = generate(dir, "oom");
  const DeviceAnalysis& d = g.analysis.devices.at(0);
  ASSERT_EQ(d.ooms.size(), 1u);
  const SnapshotOom& o = d.ooms[0];
  EXPECT_EQ(o.requested, g.facts["request"].get<int64_t>());
  EXPECT_EQ(o.device_free, g.facts["device_free"].get<int64_t>());
  EXPECT_EQ(o.allocated, g.facts["live"].get<int64_t>());
  EXPECT_EQ(o.reserved, g.facts["reserved"].get<int64_t>());
  EXPECT_EQ(o.cached, o.reserved - o.allocated);
  EXPECT_EQ(o.shortfall, g.facts["request"].get<int64_t>() - g.facts["device_free"].get<int64_t>());  // 8 GiB - 3 GiB
  EXPECT_EQ(o.stack, g.facts["site"].get<std::string>());
  int64_t live = 0;
  for (const SiteGroup& s : o.live) live += s.bytes;
  EXPECT_EQ(live, o.allocated);
  // AdamW's state (torch/optim frames) is a lever, with its bytes: two moments of each weight.
  const auto opt =
      std::find_if(o.levers.begin(), o.levers.end(), [](const OomLever& l) { return l.lever == "optimizer"; });
  ASSERT_NE(opt, o.levers.end());
  EXPECT_EQ(opt->bytes, group_bytes(o.live, "train.py:55 in step"));
  EXPECT_FALSE(opt->avoids);  // 762 MiB of state against 5 GiB short
}

// The round trip: headroom's cpu caching allocator writes the snapshot; analyze reads back the
// peaks the same run's metrics report, the steps as its iterations, and the replay of the trace
// through the same policy reaches the same reserved peak.
TEST(SnapshotAnalysis, HeadroomsOwnSnapshotsRoundTrip) {
  TempDir dir;
  for (const std::string leak : {"", "keep-graph"}) {
    const std::string snap = dir.file("s" + leak + ".pickle"), metrics = dir.file("m" + leak + ".jsonl");
    const auto r =
        run_command(std::string(HEADROOM_BINARY) +
                    " train --model tiny --steps 8 --batch 2 --seq 64 --eval-rows 0 --allocator caching "
                    "--memory-snapshot " +
                    snap + " --metrics " + metrics + (leak.empty() ? "" : " --inject-leak " + leak) + " --quiet 2>&1");
    ASSERT_EQ(r.code, 0) << r.out;
    int64_t peak = 0, reserved = 0;
    for (const auto& j : read_jsonl(metrics)) {
      peak = std::max(peak, j["peak_bytes"].get<int64_t>());
      reserved = std::max(reserved, j["peak_reserved_bytes"].get<int64_t>());
    }
    const SnapshotAnalysis a = analyze_snapshot(read_memory_snapshot(snap), snap);
    const DeviceAnalysis& d = a.devices.at(0);
    EXPECT_EQ(d.peak_allocated, peak) << leak;
    EXPECT_EQ(d.peak_reserved, reserved) << leak;
    ASSERT_FALSE(d.replays.empty());
    EXPECT_EQ(d.replays[0].peak_reserved, reserved) << leak;
    ASSERT_TRUE(d.iterations_found) << d.iterations_reason;
    EXPECT_EQ(d.iterations.size(), 8u) << d.iterations_reason;
    EXPECT_EQ(d.leak.detected, !leak.empty()) << d.leak.reason;
    if (!leak.empty()) {
      // The graph each step keeps: made in forward and backward of every step, as the frames say.
      ASSERT_FALSE(d.leak.sites.empty());
      EXPECT_NE(d.leak.sites[0].origin.find("headroom:0 in step N "), std::string::npos) << d.leak.sites[0].origin;
    }
  }
}

TEST(AnalyzeCommand, JsonAndAnHtmlReportWhoseChartStaysSmall) {
  TempDir dir;
  const Generated g = generate(dir, "leak");
  const std::string html = dir.file("r.html");
  const auto r = run_command(std::string(HEADROOM_BINARY) + " analyze --json --report " + html + " " + g.path);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  const auto& d = j["devices"][0];
  EXPECT_EQ(d["peak"]["allocated"].get<int64_t>(), g.facts["peak_allocated"].get<int64_t>());
  EXPECT_TRUE(d["leak"]["detected"].get<bool>());
  EXPECT_EQ(d["leak"]["sites"][0]["origin"], "train.py:77 in remember");
  std::ifstream f(html);
  const std::string page{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  EXPECT_NE(page.find("<svg"), std::string::npos);
  EXPECT_EQ(page.find("<script"), std::string::npos);
  EXPECT_EQ(page.find("http://"), page.find("http://www.w3.org/2000/svg"));  // no network but the SVG namespace
  EXPECT_NE(page.find("train.py:77 in remember"), std::string::npos);
  // One polygon and one line for the whole trace, whatever its length.
  size_t polylines = 0;
  for (size_t at = page.find("<polyline"); at != std::string::npos; at = page.find("<polyline", at + 1)) ++polylines;
  EXPECT_EQ(polylines, 1u);
}

TEST(AnalyzeCommand, BadInputIsOneLineAndExitTwo) {
  TempDir dir;
  const std::string hostile = dir.file("hostile.pickle");
  std::ofstream(hostile, std::ios::binary) << std::string(
      "\x80\x02"
      "cposix\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.",
      35);
  const std::string list = dir.file("list.pickle");
  std::ofstream(list, std::ios::binary) << std::string("\x80\x02]q\x00.", 6);
  const std::string empty = dir.file("empty.pickle");
  std::ofstream(empty, std::ios::binary) << "";
  for (const auto& [file, needle] :
       std::vector<std::pair<std::string, std::string>>{{hostile, "GLOBAL"},
                                                        {list, "expected a dict"},
                                                        {empty, "empty input"},
                                                        {dir.file("missing.pickle"), "cannot open"}}) {
    const auto r = run_command(std::string(HEADROOM_BINARY) + " analyze " + file + " 2>&1");
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  }
}

// Sizes up to 2^48 bytes each are read, whatever they add up to; beyond, the file is refused.
TEST(AnalyzeCommand, ExtremeSizesAreAnalysedOrRefusedNeverACrash) {
  TempDir dir;
  const std::string script = dir.file("extreme.py");
  std::ofstream(script) << R"(import pickle, sys
ev = lambda a, addr, size, s=0: dict(action=a, addr=addr, size=size, stream=s, time_us=1, frames=[])
T = int(sys.argv[2])
trace = [ev('segment_alloc', 0, T), ev('alloc', 0, T - 5), ev('alloc', -5, T, -7), ev('free_completed', 0, T - 5),
         dict(action='oom', size=T, device_free=0, stream=0, time_us=2), ev('segment_free', 0, T),
         ev('free_completed', 12345, 77)]
pickle.dump({'segments': [], 'device_traces': [trace]}, open(sys.argv[1], 'wb'))
)";
  for (const auto& [size, code] : std::vector<std::pair<std::string, int>>{{"140737488355328", 0},     // 2^47
                                                                           {"281474976710657", 2}}) {  // 2^48 + 1
    const std::string snap = dir.file("x" + size + ".pickle");
    ASSERT_EQ(run_command(std::string(HEADROOM_PYTHON) + " " + script + " " + snap + " " + size).code, 0);
    const auto r = run_command(std::string(HEADROOM_BINARY) + " analyze " + snap + " 2>&1");
    EXPECT_EQ(r.code, code) << r.out;
    if (code == 2) {
      EXPECT_NE(r.out.find("a byte count from 0 to 2^48"), std::string::npos) << r.out;
    }
  }
}

}  // namespace
}  // namespace headroom
