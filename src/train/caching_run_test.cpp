// Training on the cpu caching allocator: reserved bytes in the metrics, a memory snapshot that
// Python and memory_viz read, and the fragmentation that a budget on reserved bytes exposes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "estimate/estimator.h"
#include "testing/command.h"
#include "testing/jsonl.h"
#include "testing/temp_dir.h"
#include "train/trainer.h"
#include "util/error.h"

namespace headroom {
namespace {

using testing::read_jsonl;
using testing::TempDir;

RunConfig tiny_caching(int64_t steps) {
  RunConfig cfg;
  cfg.model = "tiny";
  cfg.steps = steps;
  cfg.device = "cpu";
  cfg.quiet = true;
  cfg.eval_rows = 0;
  cfg.allocator = AllocatorKind::caching;
  cfg.allocator_conf = "backend:native";
  return cfg;
}

// The fragmentation demonstration (docs/caching-allocator.md): gpt2's widths at two layers, batch 2 x seq 32, under a
// budget its live bytes fit and fixed segments do not.
RunConfig fragmentation_demo(int64_t steps) {
  RunConfig cfg = tiny_caching(steps);
  cfg.model = "gpt2";
  cfg.overrides = {"n_layer=2"};
  cfg.batch = 2;
  cfg.seq = 32;
  cfg.memory_budget = 1'198'000'000;
  return cfg;
}

std::string run_command(const std::string& command) {
  const auto r = testing::run_command(command);
  return r.code == 0 ? r.out : r.out + "\n(exit status " + std::to_string(r.code) + ")";
}

TEST(CachingRun, MetricsCarryReservedBytesAtLeastTheLiveOnes) {
  TempDir dir;
  RunConfig cfg = tiny_caching(3);
  cfg.metrics = dir.file("m.jsonl");
  const TrainResult r = train(cfg);
  const auto lines = read_jsonl(cfg.metrics);
  ASSERT_EQ(lines.size(), 3u);
  for (const auto& j : lines) {
    ASSERT_TRUE(j.contains("reserved_bytes") && j.contains("peak_reserved_bytes")) << j.dump();
    // Segments hold at least the blocks, which hold at least the bytes asked for.
    EXPECT_GE(j["peak_reserved_bytes"].get<int64_t>(), j["peak_bytes"].get<int64_t>());
    // Whole 2 MiB small segments and 2 MiB-rounded large ones.
    EXPECT_EQ(j["reserved_bytes"].get<int64_t>() % (2 << 20), 0);
  }
  ASSERT_TRUE(r.summary.peak_reserved_bytes);
  // The counting allocator has no reserved memory to report.
  cfg.allocator = AllocatorKind::counting;
  cfg.metrics = dir.file("counting.jsonl");
  train(cfg);
  EXPECT_FALSE(read_jsonl(cfg.metrics)[0].contains("reserved_bytes"));
}

// The snapshot, read by the venv's Python with nothing but pickle: PyTorch's keys, and a trace
// whose segment events add up to the peak reserved bytes the metrics report.
TEST(CachingRun, TheMemorySnapshotLoadsInPythonAndItsTraceReplaysToThePeakReserved) {
  TempDir dir;
  RunConfig cfg = tiny_caching(2);
  cfg.metrics = dir.file("m.jsonl");
  cfg.memory_snapshot = dir.file("snapshot.pickle");
  train(cfg);
  int64_t peak_reserved = 0;
  for (const auto& j : read_jsonl(cfg.metrics)) {
    peak_reserved = std::max(peak_reserved, j["peak_reserved_bytes"].get<int64_t>());
  }
  const std::string script = dir.file("check.py");
  std::ofstream(script) << R"(import pickle, sys
with open(sys.argv[1], 'rb') as f:
    s = pickle.load(f)
assert {'segments', 'device_traces', 'allocator_settings'} <= set(s), sorted(s)
for seg in s['segments']:
    assert {'device', 'address', 'total_size', 'allocated_size', 'active_size', 'requested_size', 'stream',
            'segment_type', 'is_expandable', 'blocks'} <= set(seg), sorted(seg)
    assert sum(b['size'] for b in seg['blocks']) == seg['total_size']
    for b in seg['blocks']:
        assert {'address', 'size', 'requested_size', 'state'} <= set(b), sorted(b)
        assert b['state'] in ('active_allocated', 'inactive')
trace = s['device_traces'][0]
actions = {e['action'] for e in trace}
assert {'alloc', 'free_requested', 'free_completed', 'segment_alloc'} <= actions, actions
reserved = peak = 0
for e in trace:
    assert {'action', 'addr', 'size', 'stream', 'time_us'} <= set(e), sorted(e)
    if e['action'] in ('segment_alloc', 'segment_map'):
        reserved += e['size']
        peak = max(peak, reserved)
    elif e['action'] in ('segment_free', 'segment_unmap'):
        reserved -= e['size']
assert reserved == sum(seg['total_size'] for seg in s['segments']), (reserved, len(s['segments']))
assert any(f['name'].startswith('step ') for e in trace for f in e.get('frames', []))
print(peak)
)";
  const std::string out = run_command(std::string(HEADROOM_PYTHON) + " " + script + " " + cfg.memory_snapshot + " 2>&1");
  EXPECT_EQ(out, std::to_string(peak_reserved) + "\n");
}

TEST(CachingRun, ASnapshotNeedsACachingAllocator) {
  RunConfig cfg = tiny_caching(1);
  cfg.allocator = AllocatorKind::counting;
  cfg.memory_snapshot = "/tmp/never-written.pickle";
  EXPECT_THROW(train(cfg), Error);
}

// The OOM guard's cache policy (memory/cache_policy.h) on cpu, on the demonstration below: the live
// bytes and the request fit the budget, so the guard first runs the same micro-batch again in
// expandable segments; here the earlier segments stay split, so it then halves the micro-batch.
// An injected fault says nothing about segments: the guard halves at once.
TEST(CachingRun, TheGuardTriesExpandableSegmentsWhenTheSegmentsNotTheBytesRanOut) {
  RunConfig cfg = fragmentation_demo(1);
  cfg.quiet = false;
  ::testing::internal::CaptureStderr();
  train(cfg);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, ::testing::HasSubstr("fit the 1.12 GiB cap; the allocator's segments"));
  EXPECT_THAT(err, ::testing::HasSubstr("expandable segments on, same micro-batch again"));

  RunConfig injected = tiny_caching(1);
  injected.batch = 8;
  injected.memory_budget = int64_t{1} << 30;
  injected.inject_oom = parse_oom_injection("1:above:1MiB");
  const TrainResult r = train(injected);
  ASSERT_FALSE(r.oom);
  EXPECT_EQ(r.steps[0].batch, 4);
}

// The fragmentation demonstration (docs/caching-allocator.md): gpt2's widths at two layers, under a budget its live
// bytes fit (1,165,859,794 at the peak: 2.7% to spare) but fixed segments do not — the embedding's
// 147 MiB gradient needs a new segment while 30-odd MiB sit free inside split ones. With expandable
// segments the same run fits, and the estimator says both before either runs.
TEST(CachingRun, FragmentationFailsFixedSegmentsThatExpandableSegmentsFit) {
  RunConfig cfg = fragmentation_demo(2);
  cfg.no_guard = true;
  const TrainResult fixed = train(cfg);
  ASSERT_TRUE(fixed.oom) << "fixed segments fit";
  cfg.allocator_conf = "expandable_segments:True";
  const TrainResult expandable = train(cfg);
  ASSERT_FALSE(expandable.oom) << expandable.oom->message;
  EXPECT_LT(expandable.summary.peak_bytes, *cfg.memory_budget);
  EXPECT_LE(*expandable.summary.peak_reserved_bytes, *cfg.memory_budget);
  // The failure was the segments', not the live bytes': they and the request fit the budget.
  const auto& oom = *fixed.oom;
  EXPECT_LT(oom.in_use + oom.requested, *cfg.memory_budget);

  const ModelConfig model = load_model_config(cfg.model, cfg.overrides);
  EXPECT_FALSE(estimate(model, train_spec(cfg)).reserved->oom);
  cfg.allocator_conf = "backend:native";
  EXPECT_TRUE(estimate(model, train_spec(cfg)).reserved->oom);
}

}  // namespace
}  // namespace headroom
