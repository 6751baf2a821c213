// Fuzzing `headroom analyze`'s input path — the pickle reader, the snapshot's schema and the
// analysis — with rapidcheck over random bytes and mutated snapshots (one Python wrote, one
// LibTorch's pickler wrote): each input is either analysed or refused with headroom::Error (the
// one-line message, exit 2), never a crash, another exception, a hang or an unbounded allocation.
// 1000 cases a property from a fixed seed; RC_PARAMS="max_success=100000" runs more.
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "device/pickle_adapter.h"
#include "snapshot/memory_snapshot.h"
#include "snapshot/pickle_reader.h"
#include "snapshot/snapshot_analysis.h"
#include "testing/command.h"
#include "testing/temp_dir.h"

namespace headroom {
namespace {

const bool kRapidcheckParams = [] {
  ::setenv("RC_PARAMS", "max_success=1000 seed=1", /*overwrite=*/0);
  return true;
}();

// The fragmentation and training snapshots of tools/snapshot_gen.py (Python's pickle, protocol 4:
// the training one appends its trace in two batches, the first of which the reader drops as it
// goes), and one that LibTorch's pickler writes (protocol 2, as PyTorch's C++ side does).
const std::vector<std::string>& seeds() {
  static const std::vector<std::string> s = [] {
    testing::TempDir dir;
    std::vector<std::string> v;
    for (const char* scenario : {"fragmentation", "training"}) {
      const std::string out = dir.file(std::string(scenario) + ".pickle");
      const auto r = testing::run_command(std::string(HEADROOM_PYTHON) + " " + HEADROOM_SOURCE_DIR +
                                          "/tools/snapshot_gen.py " + scenario + " " + out + " 2>&1");
      EXPECT_EQ(r.code, 0) << r.out;
      std::ifstream f(out, std::ios::binary);
      v.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
    using J = nlohmann::json;
    const J frames = J::array({J{{"filename", "train.py"}, {"line", 3}, {"name", "step"}}});
    const J blocks = J::array({J{{"address", 1 << 21},
                                 {"size", 512},
                                 {"requested_size", 100},
                                 {"state", "active_allocated"},
                                 {"frames", frames}},
                               J{{"address", (1 << 21) + 512}, {"size", (2 << 20) - 512}, {"state", "inactive"}}});
    const J segment = {{"device", 0}, {"address", 1 << 21},      {"total_size", 2 << 20},
                       {"stream", 0}, {"segment_type", "small"}, {"blocks", blocks}};
    const J trace = J::array(
        {J{{"action", "segment_alloc"}, {"addr", 1 << 21}, {"size", 2 << 20}, {"stream", 0}, {"time_us", 1}},
         J{{"action", "alloc"}, {"addr", 1 << 21}, {"size", 100}, {"stream", 0}, {"time_us", 2}, {"frames", frames}},
         J{{"action", "oom"}, {"size", 1 << 30}, {"device_free", 0}, {"stream", 0}, {"time_us", 3}}});
    J snapshot = J::object();
    snapshot["segments"] = J::array({segment});
    snapshot["device_traces"] = J::array({trace});
    snapshot["allocator_settings"] = {{"PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"}};
    v.push_back(pickle_value(snapshot));
    return v;
  }();
  return s;
}

// Read (both ways: the document whole, and streaming with the trace taken as it is read), then
// (if it is a snapshot) analyse: only headroom::Error may escape.
void read_and_analyze(const std::string& bytes) {
  for (const bool streaming : {false, true}) {
    try {
      const MemorySnapshot snap = streaming ? read_memory_snapshot_bytes(bytes, "fuzz")
                                            : memory_snapshot_from(read_pickle_bytes(bytes), "fuzz");
      const SnapshotAnalysis a = analyze_snapshot(snap, "fuzz");
      RC_ASSERT(!a.to_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).empty());
    } catch (const Error& e) {
      RC_ASSERT(std::string(e.what()).find('\n') == std::string::npos);
    }
  }
}

rc::Gen<std::string> mutated() {
  return rc::gen::exec([] {
    std::string s = *rc::gen::elementOf(seeds());
    const int edits = *rc::gen::inRange(1, 6);
    for (int e = 0; e < edits && !s.empty(); ++e) {
      const size_t at = *rc::gen::inRange<size_t>(0, s.size());
      switch (*rc::gen::inRange(0, 6)) {
        case 0: s[at] = *rc::gen::arbitrary<char>(); break;
        case 1:  // an opcode, maybe a hostile one
          s.insert(at, 1, *rc::gen::elementOf(std::string("c\x93RbioQ\x81(.0122e]}ustqhjr\x94\x95\x8a\x8b\x8d\x8e")));
          break;
        case 2: s.erase(at, 1); break;
        case 3: s.resize(at); break;
        case 4: s.replace(at, std::min<size_t>(8, s.size() - at), std::string(8, '\xff')); break;  // huge lengths
        case 5: s.replace(at, std::min<size_t>(4, s.size() - at), std::string("\x7f\xff\xff\x7f", 4)); break;
      }
    }
    return s;
  });
}

TEST(SnapshotFuzz, TheSeedsAreSnapshots) {
  for (const std::string& s : seeds()) {
    const MemorySnapshot snap = memory_snapshot_from(read_pickle_bytes(s), "seed");
    EXPECT_FALSE(snap.segments.empty());
    EXPECT_FALSE(snap.traces.at(0).empty());
  }
}

RC_GTEST_PROP(SnapshotFuzz, RandomBytesAreReadOrRefused, ()) {
  const auto bytes = *rc::gen::container<std::string>(rc::gen::arbitrary<char>());
  read_and_analyze(bytes);
}

RC_GTEST_PROP(SnapshotFuzz, MutatedSnapshotsAreAnalysedOrRefused, ()) { read_and_analyze(*mutated()); }

TEST(SnapshotFuzz, EveryTruncationOfASnapshotIsRefused) {
  for (size_t k : {size_t{0}, size_t{2}}) {  // the small ones
    const std::string& s = seeds()[k];
    for (size_t n = 0; n + 1 < s.size(); ++n) {
      EXPECT_THROW(memory_snapshot_from(read_pickle_bytes(std::string_view(s).substr(0, n)), "cut"), Error) << n;
      EXPECT_THROW(read_memory_snapshot_bytes(std::string_view(s).substr(0, n), "cut"), Error) << n;
    }
  }
}

// Structures a small file can make huge through the memo, refused by name; and overlapping
// segments over a long blocks list, analysed in one sweep.
TEST(SnapshotFuzz, SharedAndOverlappingStructuresAreRefusedOrBounded) {
  testing::TempDir dir;
  const std::string script = dir.file("hostile.py");
  std::ofstream(script) << R"(import pickle, sys
ev = dict(action='alloc', addr=0, size=512, stream=0, time_us=1, frames=[])
blocks = [dict(address=i * 512, size=512, requested_size=512, state='active_allocated', frames=[]) for i in range(2000)]
seg = dict(address=0, total_size=2000 * 512, blocks=blocks)
cases = {
  'shared_blocks': {'segments': [seg] + [dict(address=2**30 + i * 2**21, total_size=2**21, blocks=blocks) for i in range(2)]},
  'shared_trace': {'segments': [], 'device_traces': [[ev], [ev]][:1] * 2},
  'same_event': {'segments': [], 'device_traces': [[ev] * 5]},
  'overlapping': {'segments': [dict(address=0, total_size=2**40, blocks=[dict(size=512, state='active_allocated')] * 20000)]
                  + [dict(address=i * 4096, total_size=2**21, blocks=[]) for i in range(1, 20000)]},
}
for name, value in cases.items():
    pickle.dump(value, open(sys.argv[1] + '/' + name + '.pickle', 'wb'))
)";
  ASSERT_EQ(testing::run_command(std::string(HEADROOM_PYTHON) + " " + script + " " + dir.path()).code, 0);
  for (const auto& [name, needle] : std::vector<std::pair<std::string, std::string>>{
           {"shared_blocks", "segments[1].blocks: expected a list of its own"},
           {"shared_trace", "device_traces[1]: expected a list of its own"},
           {"same_event", "an event of its own"}}) {
    try {
      read_memory_snapshot(dir.file(name + ".pickle"));
      ADD_FAILURE() << name << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  const SnapshotAnalysis a = analyze_snapshot(read_memory_snapshot(dir.file("overlapping.pickle")), "overlapping");
  EXPECT_EQ(a.devices.at(0).segments, 20000);
}

}  // namespace
}  // namespace headroom
