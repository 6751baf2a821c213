#include "snapshot/memory_snapshot.h"

#include <fmt/format.h>

#include <functional>
#include <limits>
#include <unordered_map>

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

// Reads the document by the schema, naming the place of anything wrong.
class SnapshotReader {
 public:
  SnapshotReader(const PickleDocument& doc, const std::string& name) : doc_(doc), name_(name) {}

  MemorySnapshot read() {
    const Ref root = doc_.root();
    if (!doc_.is(root, Kind::dict)) {
      bad("the top level", "a dict with \"segments\" and \"device_traces\" (torch.cuda.memory._snapshot())");
    }
    const auto segments = doc_.get(root, "segments");
    if (!segments) {
      fail(
          "{}: no \"segments\" key at the top level; a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot) "
          "has \"segments\" and \"device_traces\"",
          name_);
    }
    expect(*segments, Kind::list, "segments");
    uint64_t i = 0;
    doc_.for_each(*segments, [&](Ref s) {
      read_segment(s, i++);
      return true;
    });
    if (const auto traces = doc_.get(root, "device_traces")) {
      expect(*traces, Kind::list, "device_traces");
      uint64_t d = 0;
      doc_.for_each(*traces, [&](Ref t) {
        read_trace(t, d++);
        return true;
      });
    }
    if (const auto settings = doc_.get(root, "allocator_settings"); settings && doc_.is(*settings, Kind::dict)) {
      read_settings(*settings);
    }
    return std::move(out_);
  }

 private:
  [[noreturn]] void bad(const std::string& where, const std::string& expected) {
    fail("{}: {}: expected {}", name_, where, expected);
  }
  void expect(Ref r, Kind k, const std::string& where) {
    if (!doc_.is(r, k)) bad(where, k == Kind::list ? "a list" : "a dict");
  }
  // A dict of at most `limit` keys (events, blocks and frames have a handful: a huge one is hostile,
  // and would make every lookup slow).
  void expect_record(Ref r, const std::string& where) {
    if (!doc_.is(r, Kind::dict)) bad(where, "a dict");
    if (doc_.size(r) > 256) bad(where, fmt::format("a record of a few keys, not {}", doc_.size(r)));
  }
  int64_t integer(Ref v, const char* key, const std::function<std::string()>& where) {
    const auto i = doc_.integer(v);
    if (!i) bad(where() + "." + key, "an int");
    return *i;
  }

  StackId read_stack(Ref frames, const std::function<std::string()>& where) {
    if (const auto it = stack_by_ref_.find(frames.bits); it != stack_by_ref_.end()) return it->second;
    if (!doc_.is(frames, Kind::list)) bad(where() + ".frames", "a list of frames");
    std::vector<int32_t> ids;
    doc_.for_each(frames, [&](Ref f) {
      ids.push_back(read_frame(f, where));
      return true;
    });
    std::string key(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int32_t));
    auto [it, inserted] = stack_by_content_.try_emplace(std::move(key), static_cast<StackId>(out_.stacks.size()));
    if (inserted) out_.stacks.push_back(std::move(ids));
    stack_by_ref_.emplace(frames.bits, it->second);
    return it->second;
  }
  int32_t read_frame(Ref f, const std::function<std::string()>& where) {
    if (const auto it = frame_by_ref_.find(f.bits); it != frame_by_ref_.end()) return it->second;
    expect_record(f, where() + ".frames[]");
    SnapshotFrame frame;
    doc_.for_each_item(f, [&](Ref k, Ref v) {
      const auto key = doc_.text(k);
      if (!key) return true;
      if (*key == "filename")
        frame.filename = std::string(doc_.text(v).value_or(""));
      else if (*key == "name")
        frame.name = std::string(doc_.text(v).value_or(""));
      else if (*key == "line")
        frame.line = doc_.integer(v).value_or(0);
      return true;
    });
    std::string key = fmt::format("{}\n{}\n{}", frame.filename, frame.line, frame.name);
    auto [it, inserted] = frame_by_content_.try_emplace(std::move(key), static_cast<int32_t>(out_.frames.size()));
    if (inserted) out_.frames.push_back(std::move(frame));
    frame_by_ref_.emplace(f.bits, it->second);
    return it->second;
  }

  void read_segment(Ref s, uint64_t i) {
    const auto where = [&] { return fmt::format("segments[{}]", i); };
    expect_record(s, where());
    SnapshotSegment seg;
    bool has_address = false, has_size = false;
    std::optional<Ref> blocks;
    doc_.for_each_item(s, [&](Ref k, Ref v) {
      const auto key = doc_.text(k);
      if (!key) return true;
      if (*key == "address")
        seg.address = static_cast<uint64_t>(integer(v, "address", where)), has_address = true;
      else if (*key == "total_size")
        seg.total_size = integer(v, "total_size", where), has_size = true;
      else if (*key == "device")
        seg.device = integer(v, "device", where);
      else if (*key == "stream")
        seg.stream = integer(v, "stream", where);
      else if (*key == "segment_type")
        seg.small = doc_.text(v).value_or("") == "small";
      else if (*key == "is_expandable")
        seg.expandable = doc_.integer(v).value_or(0) != 0;
      else if (*key == "blocks")
        blocks = v;
      return true;
    });
    if (!has_address) bad(where() + ".address", "an int (the segment's address)");
    if (!has_size) bad(where() + ".total_size", "an int (the segment's bytes)");
    if (seg.total_size < 0) bad(where() + ".total_size", "a size of 0 bytes or more");
    if (blocks) {
      expect(*blocks, Kind::list, where() + ".blocks");
      uint64_t b = 0;
      uint64_t next = seg.address;
      doc_.for_each(*blocks, [&](Ref r) {
        const auto bwhere = [&] { return fmt::format("segments[{}].blocks[{}]", i, b); };
        expect_record(r, bwhere());
        SnapshotBlock block;
        block.address = next;
        bool has_state = false, has_requested = false, has_bsize = false;
        doc_.for_each_item(r, [&](Ref k, Ref v) {
          const auto key = doc_.text(k);
          if (!key) return true;
          if (*key == "address")
            block.address = static_cast<uint64_t>(integer(v, "address", bwhere));
          else if (*key == "size")
            block.size = integer(v, "size", bwhere), has_bsize = true;
          else if (*key == "requested_size")
            block.requested = integer(v, "requested_size", bwhere), has_requested = true;
          else if (*key == "frames")
            block.stack = read_stack(v, bwhere);
          else if (*key == "state") {
            const auto t = doc_.text(v).value_or("");
            has_state = true;
            if (t == "active_allocated")
              block.state = BlockState::active_allocated;
            else if (t == "active_awaiting_free" || t == "active_pending_free")
              block.state = BlockState::active_awaiting_free;
            else if (t == "inactive")
              block.state = BlockState::inactive;
            else
              bad(bwhere() + ".state", "\"active_allocated\", \"active_awaiting_free\" or \"inactive\"");
          }
          return true;
        });
        if (!has_bsize || block.size < 0) bad(bwhere() + ".size", "an int of 0 or more (the block's bytes)");
        if (!has_state) bad(bwhere() + ".state", "\"active_allocated\", \"active_awaiting_free\" or \"inactive\"");
        if (!has_requested) block.requested = block.state == BlockState::inactive ? 0 : block.size;
        next = block.address + static_cast<uint64_t>(block.size);
        seg.blocks.push_back(block);
        ++b;
        return true;
      });
    }
    out_.segments.push_back(std::move(seg));
  }

  void read_trace(Ref t, uint64_t d) {
    expect(t, Kind::list, fmt::format("device_traces[{}]", d));
    std::vector<SnapshotEvent> events;
    events.reserve(doc_.size(t));
    uint64_t i = 0;
    doc_.for_each(t, [&](Ref e) {
      const auto where = [&] { return fmt::format("device_traces[{}][{}]", d, i); };
      expect_record(e, where());
      SnapshotEvent ev;
      bool has_action = false, has_size = false, has_addr = false;
      doc_.for_each_item(e, [&](Ref k, Ref v) {
        const auto key = doc_.text(k);
        if (!key) return true;
        if (*key == "action") {
          const auto a = doc_.text(v);
          if (!a) bad(where() + ".action", "a str");
          has_action = true;
          ev.action = action(*a);
        } else if (*key == "size") {
          ev.size = integer(v, "size", where), has_size = true;
        } else if (*key == "addr") {
          ev.address = static_cast<uint64_t>(integer(v, "addr", where)), has_addr = true;
        } else if (*key == "stream") {
          ev.stream = integer(v, "stream", where);
        } else if (*key == "time_us") {
          ev.time_us = doc_.number(v).has_value() ? static_cast<int64_t>(*doc_.number(v)) : 0;
        } else if (*key == "device_free") {
          ev.device_free = integer(v, "device_free", where);
        } else if (*key == "frames") {
          ev.stack = read_stack(v, where);
        }
        return true;
      });
      if (!has_action) bad(where() + ".action", "a str (alloc, free_requested, free_completed, segment_alloc, ...)");
      const bool addressed = ev.action != SnapshotAction::oom && ev.action != SnapshotAction::snapshot &&
                             ev.action != SnapshotAction::other;
      if (addressed && !has_addr) bad(where() + ".addr", "an int (the block's or segment's address)");
      if (ev.action != SnapshotAction::snapshot && ev.action != SnapshotAction::other && (!has_size || ev.size < 0)) {
        bad(where() + ".size", "an int of 0 or more");
      }
      events.push_back(ev);
      ++i;
      return true;
    });
    out_.traces.push_back(std::move(events));
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
    doc_.for_each_item(s, [&](Ref k, Ref v) {
      const auto key = doc_.text(k);
      if (!key) return true;
      if (*key == "PYTORCH_CUDA_ALLOC_CONF")
        a.conf = std::string(doc_.text(v).value_or(""));
      else if (*key == "expandable_segments")
        a.expandable_segments = doc_.integer(v).value_or(0) != 0;
      else if (*key == "garbage_collection_threshold")
        a.garbage_collection_threshold = doc_.number(v).value_or(0);
      else if (*key == "max_split_size") {
        const int64_t m = doc_.integer(v).value_or(-1);
        a.max_split_size = (m <= 0 || m >= (int64_t{1} << 60)) ? -1 : m;
      }
      return true;
    });
  }

  const PickleDocument& doc_;
  const std::string& name_;
  MemorySnapshot out_;
  std::unordered_map<uint64_t, StackId> stack_by_ref_;
  std::unordered_map<std::string, StackId> stack_by_content_;
  std::unordered_map<uint64_t, int32_t> frame_by_ref_;
  std::unordered_map<std::string, int32_t> frame_by_content_;
};

}  // namespace

MemorySnapshot memory_snapshot_from(const PickleDocument& doc, const std::string& name) {
  return SnapshotReader(doc, name).read();
}

MemorySnapshot read_memory_snapshot(const std::string& path) {
  const PickleDocument doc = read_pickle_file(path);
  return memory_snapshot_from(doc, path);
}

}  // namespace headroom
