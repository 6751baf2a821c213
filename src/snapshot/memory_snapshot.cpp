#include "snapshot/memory_snapshot.h"

#include <fmt/format.h>

#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <unordered_map>
#include <unordered_set>

namespace headroom {

const char* snapshot_action_name(SnapshotAction a) {
  switch (a) {
    case SnapshotAction::alloc: return "alloc";
    case SnapshotAction::free_requested: return "free_requested";
    case SnapshotAction::free_completed: return "free_completed";
    case SnapshotAction::segment_alloc: return "segment_alloc";
    case SnapshotAction::segment_free: return "segment_free";
    case SnapshotAction::segment_map: return "segment_map";
    case SnapshotAction::segment_unmap: return "segment_unmap";
    case SnapshotAction::oom: return "oom";
    case SnapshotAction::snapshot: return "snapshot";
    case SnapshotAction::other: return "other";
  }
  return "other";
}

namespace {

using Ref = PickleDocument::Ref;
using Kind = PickleDocument::Kind;
constexpr int64_t kMaxBytes = int64_t{1} << 48;
// Events, blocks and frames have a dozen keys at most: a record of more is hostile, and would make
// every lookup slow.
constexpr uint64_t kMaxKeys = 64;

// Where in the snapshot a value is, spelled out only for an error message.
struct Place {
  enum Kind { segment, block, event, trace_event } kind;
  uint64_t a = 0, b = 0;
  std::string str() const {
    switch (kind) {
      case segment: return fmt::format("segments[{}]", a);
      case block: return fmt::format("segments[{}].blocks[{}]", a, b);
      case event: return fmt::format("device_traces[{}][{}]", a, b);
      case trace_event: return fmt::format("device_traces[…][{}]", b);
    }
    return "";
  }
};

// Reads the document by the schema, naming the place of anything wrong. As the document's sink, it
// takes each device trace's events while the pickle is read, so that the trace never sits in the
// document as a tree.
class SnapshotReader : public PickleSink {
 public:
  explicit SnapshotReader(const std::string& name) : name_(name) {}

  bool take(const PickleDocument& document, uint64_t list_id, const void* items, size_t n) override {
    if (n == 0 || declined_.count(list_id)) return false;
    doc_ = &document;
    auto it = taken_.find(list_id);
    if (it == taken_.end()) {
      // A trace: its first item is an event (a record with an "action").
      const Ref first = PickleDocument::item(items, 0);
      if (!doc().is(first, Kind::dict) || doc().size(first) > kMaxKeys || !doc().get(first, "action")) {
        declined_.insert(list_id);
        return false;
      }
      it = taken_.emplace(list_id, std::deque<SnapshotEvent>()).first;
    }
    // The same event dict twice in a batch (a memo reference) would be read twice; a trace never
    // shares its events.
    std::unordered_set<uint64_t> seen;
    for (size_t k = 0; k < n; ++k) {
      const Ref e = PickleDocument::item(items, k);
      const Place where{Place::trace_event, 0, it->second.size()};
      if (!seen.insert(e.bits).second) bad(where.str(), "an event of its own, not another event again");
      it->second.push_back(read_event(e, where));
    }
    return true;
  }

  MemorySnapshot read(const PickleDocument& document) {
    doc_ = &document;
    const Ref root = doc().root();
    if (!doc().is(root, Kind::dict)) {
      bad("the top level", "a dict with \"segments\" and \"device_traces\" (torch.cuda.memory._snapshot())");
    }
    const auto segments = doc().get(root, "segments");
    if (!segments) {
      fail(
          "{}: no \"segments\" key at the top level; a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot) "
          "has \"segments\" and \"device_traces\"",
          name_);
    }
    expect(*segments, Kind::list, "segments");
    uint64_t i = 0;
    doc().for_each(*segments, [&](Ref s) {
      read_segment(s, i++);
      return true;
    });
    if (const auto traces = doc().get(root, "device_traces")) {
      expect(*traces, Kind::list, "device_traces");
      uint64_t d = 0;
      doc().for_each(*traces, [&](Ref t) {
        read_trace(t, d++);
        return true;
      });
    }
    if (const auto settings = doc().get(root, "allocator_settings"); settings && doc().is(*settings, Kind::dict)) {
      read_settings(*settings);
    }
    return std::move(out_);
  }

 private:
  [[noreturn]] void bad(const std::string& where, const std::string& expected) {
    fail("{}: {}: expected {}", name_, where, expected);
  }
  void expect(Ref r, Kind k, const std::string& where) {
    if (!doc().is(r, k)) bad(where, k == Kind::list ? "a list" : "a dict");
  }
  // A dict of at most `limit` keys (events, blocks and frames have a handful: a huge one is hostile,
  // and would make every lookup slow).
  void expect_record(Ref r, const Place& where, const char* suffix = "") {
    if (!doc().is(r, Kind::dict)) bad(where.str() + suffix, "a dict");
    if (doc().size(r) > kMaxKeys)
      bad(where.str() + suffix, fmt::format("a record of a few keys, not {}", doc().size(r)));
  }
  int64_t integer(Ref v, const char* key, const Place& where) {
    const auto i = doc().integer(v);
    if (!i) bad(where.str() + "." + key, "an int");
    return *i;
  }
  // A stream's index in the snapshot's table of them.
  uint16_t stream(int64_t id, const Place& where) {
    auto [it, inserted] = stream_index_.try_emplace(id, out_.streams.size());
    if (inserted) {
      if (out_.streams.size() >= 65536) bad(where.str() + ".stream", "one of at most 65,536 streams");
      out_.streams.push_back(id);
    }
    return static_cast<uint16_t>(it->second);
  }
  // A byte count: 0 to 2^48 (256 TiB, beyond any device), so that sums over a trace stay exact.
  int64_t bytes(Ref v, const char* key, const Place& where) {
    const auto i = doc().integer(v);
    if (!i || *i < 0 || *i > kMaxBytes) bad(where.str() + "." + key, "a byte count from 0 to 2^48");
    return *i;
  }

  StackId read_stack(Ref frames, const Place& where) {
    if (const auto it = stack_by_ref_.find(frames.bits); it != stack_by_ref_.end()) return it->second;
    if (!doc().is(frames, Kind::list)) bad(where.str() + ".frames", "a list of frames");
    std::vector<int32_t> ids;
    doc().for_each(frames, [&](Ref f) {
      ids.push_back(read_frame(f, where));
      return true;
    });
    std::string key(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int32_t));
    auto [it, inserted] = stack_by_content_.try_emplace(std::move(key), static_cast<StackId>(out_.stacks.size()));
    if (inserted) out_.stacks.push_back(std::move(ids));
    stack_by_ref_.emplace(frames.bits, it->second);
    return it->second;
  }
  int32_t read_frame(Ref f, const Place& where) {
    if (const auto it = frame_by_ref_.find(f.bits); it != frame_by_ref_.end()) return it->second;
    expect_record(f, where, ".frames[]");
    SnapshotFrame frame;
    doc().for_each_item(f, [&](Ref k, Ref v) {
      const auto key = doc().text(k);
      if (!key) return true;
      if (*key == "filename")
        frame.filename = std::string(doc().text(v).value_or(""));
      else if (*key == "name")
        frame.name = std::string(doc().text(v).value_or(""));
      else if (*key == "line")
        frame.line = doc().integer(v).value_or(0);
      return true;
    });
    std::string key = fmt::format("{}\n{}\n{}", frame.filename, frame.line, frame.name);
    auto [it, inserted] = frame_by_content_.try_emplace(std::move(key), static_cast<int32_t>(out_.frames.size()));
    if (inserted) out_.frames.push_back(std::move(frame));
    frame_by_ref_.emplace(f.bits, it->second);
    return it->second;
  }

  void read_segment(Ref s, uint64_t i) {
    const Place where{Place::segment, i, 0};
    expect_record(s, where);
    SnapshotSegment seg;
    bool has_address = false, has_size = false;
    std::optional<Ref> blocks;
    doc().for_each_item(s, [&](Ref k, Ref v) {
      const auto key = doc().text(k);
      if (!key) return true;
      if (*key == "address")
        seg.address = static_cast<uint64_t>(integer(v, "address", where)), has_address = true;
      else if (*key == "total_size")
        seg.total_size = bytes(v, "total_size", where), has_size = true;
      else if (*key == "device")
        seg.device = integer(v, "device", where);
      else if (*key == "stream")
        seg.stream = stream(integer(v, "stream", where), where);
      else if (*key == "segment_type")
        seg.small = doc().text(v).value_or("") == "small";
      else if (*key == "is_expandable")
        seg.expandable = doc().integer(v).value_or(0) != 0;
      else if (*key == "blocks")
        blocks = v;
      return true;
    });
    if (!has_address) bad(where.str() + ".address", "an int (the segment's address)");
    if (!has_size) bad(where.str() + ".total_size", "an int (the segment's bytes)");
    if (seg.total_size < 0) bad(where.str() + ".total_size", "a size of 0 bytes or more");
    if (blocks) {
      expect(*blocks, Kind::list, where.str() + ".blocks");
      once(*blocks, where.str() + ".blocks");
      uint64_t b = 0;
      uint64_t next = seg.address;
      doc().for_each(*blocks, [&](Ref r) {
        const SnapshotBlock block = read_block(r, Place{Place::block, i, b}, next);
        next = block.address + static_cast<uint64_t>(block.size);
        seg.blocks.push_back(block);
        ++b;
        return true;
      });
    }
    out_.segments.push_back(std::move(seg));
  }

  // A block of a segment; without an address of its own, it starts where the one before it ended
  // (`next`).
  SnapshotBlock read_block(Ref r, const Place& where, uint64_t next) {
    expect_record(r, where);
    SnapshotBlock block;
    block.address = next;
    bool has_state = false, has_requested = false, has_size = false;
    doc().for_each_item(r, [&](Ref k, Ref v) {
      const auto key = doc().text(k);
      if (!key) return true;
      if (*key == "address")
        block.address = static_cast<uint64_t>(integer(v, "address", where));
      else if (*key == "size")
        block.size = bytes(v, "size", where), has_size = true;
      else if (*key == "requested_size")
        block.requested = bytes(v, "requested_size", where), has_requested = true;
      else if (*key == "frames")
        block.stack = read_stack(v, where);
      else if (*key == "state") {
        const auto t = doc().text(v).value_or("");
        has_state = true;
        if (t == "active_allocated")
          block.state = BlockState::active_allocated;
        else if (t == "active_awaiting_free" || t == "active_pending_free")
          block.state = BlockState::active_awaiting_free;
        else if (t == "inactive")
          block.state = BlockState::inactive;
        else
          bad(where.str() + ".state", "\"active_allocated\", \"active_awaiting_free\" or \"inactive\"");
      }
      return true;
    });
    if (!has_size || block.size < 0) bad(where.str() + ".size", "an int of 0 or more (the block's bytes)");
    if (!has_state) bad(where.str() + ".state", "\"active_allocated\", \"active_awaiting_free\" or \"inactive\"");
    if (!has_requested) block.requested = block.state == BlockState::inactive ? 0 : block.size;
    return block;
  }

  void read_trace(Ref t, uint64_t d) {
    expect(t, Kind::list, fmt::format("device_traces[{}]", d));
    once(t, fmt::format("device_traces[{}]", d));
    // Items the list was built with (the LIST opcode) come before any appended (and taken) ones.
    std::deque<SnapshotEvent> events;
    uint64_t i = 0;
    doc().for_each(t, [&](Ref e) {
      events.push_back(read_event(e, Place{Place::event, d, i++}));
      return true;
    });
    if (const auto it = taken_.find(doc().id(t)); it != taken_.end()) {
      if (events.empty()) {
        events = std::move(it->second);
      } else {
        events.insert(events.end(), it->second.begin(), it->second.end());
      }
      taken_.erase(it);
    }
    out_.traces.push_back(std::move(events));
  }

  // A list read as a trace or as a segment's blocks is read once: shared by reference (the memo),
  // it would be copied for each use — memory without bound from a small file.
  void once(Ref list, const std::string& where) {
    if (!read_lists_.insert(doc().id(list)).second) bad(where, "a list of its own, not one shared with another");
  }

  SnapshotEvent read_event(Ref e, const Place& where) {
    expect_record(e, where);
    SnapshotEvent ev;
    bool has_action = false, has_size = false, has_addr = false;
    int64_t device_free = -1;
    doc().for_each_item(e, [&](Ref k, Ref v) {
      const auto key = doc().text(k);
      if (!key) return true;
      if (*key == "action") {
        const auto a = doc().text(v);
        if (!a) bad(where.str() + ".action", "a str");
        has_action = true;
        ev.action = action(*a);
      } else if (*key == "size") {
        ev.size = bytes(v, "size", where), has_size = true;
      } else if (*key == "addr") {
        ev.address = static_cast<uint64_t>(integer(v, "addr", where)), has_addr = true;
      } else if (*key == "stream") {
        ev.stream = stream(integer(v, "stream", where), where);
      } else if (*key == "time_us") {
        const double t = doc().number(v).value_or(0);
        ev.time_us = std::isfinite(t) && std::abs(t) < 9e18 ? static_cast<int64_t>(t) : 0;
      } else if (*key == "device_free") {
        device_free = bytes(v, "device_free", where);
      } else if (*key == "frames") {
        ev.stack = read_stack(v, where);
      }
      return true;
    });
    if (!has_action) bad(where.str() + ".action", "a str (alloc, free_requested, free_completed, segment_alloc, ...)");
    const bool addressed =
        ev.action != SnapshotAction::oom && ev.action != SnapshotAction::snapshot && ev.action != SnapshotAction::other;
    if (addressed && !has_addr) bad(where.str() + ".addr", "an int (the block's or segment's address)");
    if (ev.action == SnapshotAction::oom) ev.address = device_free >= 0 ? static_cast<uint64_t>(device_free) + 1 : 0;
    if (ev.action != SnapshotAction::snapshot && ev.action != SnapshotAction::other && (!has_size || ev.size < 0)) {
      bad(where.str() + ".size", "an int of 0 or more");
    }
    return ev;
  }

  static SnapshotAction action(std::string_view a) {
    for (int k = 0; k <= static_cast<int>(SnapshotAction::snapshot); ++k) {
      const auto act = static_cast<SnapshotAction>(k);
      if (a == snapshot_action_name(act)) return act;
    }
    return SnapshotAction::other;  // later PyTorch versions may add kinds: kept, not used
  }

  void read_settings(Ref s) {
    AllocatorSettings& a = out_.settings;
    a.known = true;
    doc().for_each_item(s, [&](Ref k, Ref v) {
      const auto key = doc().text(k);
      if (!key) return true;
      if (*key == "PYTORCH_CUDA_ALLOC_CONF")
        a.conf = std::string(doc().text(v).value_or(""));
      else if (*key == "expandable_segments")
        a.expandable_segments = doc().integer(v).value_or(0) != 0;
      else if (*key == "garbage_collection_threshold")
        a.garbage_collection_threshold = doc().number(v).value_or(0);
      else if (*key == "max_split_size") {
        const int64_t m = doc().integer(v).value_or(-1);
        a.max_split_size = (m <= 0 || m >= (int64_t{1} << 60)) ? -1 : m;
      }
      return true;
    });
  }

  const PickleDocument& doc() const { return *doc_; }

  const PickleDocument* doc_ = nullptr;
  const std::string& name_;
  std::unordered_map<uint64_t, std::deque<SnapshotEvent>> taken_;  // trace lists' events, taken while reading
  std::unordered_set<uint64_t> declined_;
  std::unordered_set<uint64_t> read_lists_;
  std::unordered_map<int64_t, size_t> stream_index_;
  MemorySnapshot out_;
  std::unordered_map<uint64_t, StackId> stack_by_ref_;
  std::unordered_map<std::string, StackId> stack_by_content_;
  std::unordered_map<uint64_t, int32_t> frame_by_ref_;
  std::unordered_map<std::string, int32_t> frame_by_content_;
};

}  // namespace

MemorySnapshot memory_snapshot_from(const PickleDocument& doc, const std::string& name) {
  return SnapshotReader(name).read(doc);
}

MemorySnapshot read_memory_snapshot(const std::string& path) {
  SnapshotReader reader(path);
  const PickleDocument doc = read_pickle_file(path, &reader);
  return reader.read(doc);
}

MemorySnapshot read_memory_snapshot_bytes(std::string_view bytes, const std::string& name) {
  SnapshotReader reader(name);
  const PickleDocument doc = read_pickle_bytes(bytes, &reader);
  return reader.read(doc);
}

}  // namespace headroom
