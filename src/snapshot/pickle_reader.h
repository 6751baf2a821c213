// A safe, streaming reader of Python pickles of plain data — what PyTorch's memory snapshots are
// (torch.cuda.memory._dump_snapshot writes pickle.dump of nested dicts and lists; LibTorch's own
// unpickler takes protocol 2 only and fails on LONG1, so it cannot read them).
//
// The accepted subset: protocols 0–5 as Python writes them for None, bool, int (up to 64 bits),
// float, str, bytes, list, tuple and dict values —
//   PROTO FRAME STOP MARK POP POP_MARK DUP
//   NONE NEWTRUE NEWFALSE INT LONG BININT BININT1 BININT2 LONG1 LONG4 FLOAT BINFLOAT
//   BINUNICODE SHORT_BINUNICODE BINUNICODE8 BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES BINBYTES8
//   BYTEARRAY8 EMPTY_LIST LIST APPEND APPENDS EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_DICT DICT
//   SETITEM SETITEMS PUT BINPUT LONG_BINPUT MEMOIZE GET BINGET LONG_BINGET.
// Everything that would construct an object by name or call code (GLOBAL, STACK_GLOBAL, REDUCE,
// BUILD, INST, OBJ, NEWOBJ, NEWOBJ_EX, EXT1/2/4, PERSID, BINPERSID, out-of-band buffers) is refused,
// as are sets, protocol-0 text strings, integers wider than 64 bits and str that is not UTF-8: a
// PickleError (a headroom::Error) whose one-line message names the byte offset and the opcode.
// (Python writes bytes objects at protocols 0-2 as a call to _codecs.encode: refused like any call.
// Memory snapshots hold no bytes.)
//
// Safety: input is read in 1 MiB pieces, never trusted for a size: a declared length is read as the
// bytes arrive (a 2^60-byte string in a 100-byte file fails as truncated, having allocated ~100
// bytes), the memo grows only as far as the input could have filled it, marks nest 100,000 deep at
// most, and parsing is one loop with an explicit stack (no recursion). Memory stays under 16 times
// the input read (plus 64 MiB): a pickle built to expand further is stopped. Time is linear in it. Memo references may make a value shared or even cyclic (a list that holds itself):
// readers of a document walk it by a schema, never blindly.
//
// The result is a PickleDocument: values as tagged 64-bit references into compact tables (small ints
// inline, strings in an arena, containers as runs of references), a few times smaller than Python's
// objects for the same pickle. Not thread-safe while reading; a finished document is read-only.
//
// Streaming: a PickleSink is offered the items of each list as they are appended (Python appends in
// batches of 1000). One that takes them keeps its own compact form of them, and the list keeps none;
// when a batch made nothing but the items it hands over (the common case once a snapshot's
// tracebacks have all been seen), the document drops their memory at once, so a long trace never
// sits in memory as a tree. A later memo reference to an item handed over is an error.
#pragma once

#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "util/error.h"

namespace headroom {

class PickleError : public Error {
 public:
  // "NAME: pickle offset N: DETAIL" (without a name: "pickle offset N: DETAIL").
  PickleError(uint64_t offset, const std::string& detail, const std::string& name = "");
  uint64_t offset() const { return offset_; }
  const std::string& detail() const { return detail_; }

 private:
  uint64_t offset_;
  std::string detail_;
};

class PickleDocument;

// Offered the items appended to a list; see "Streaming" above.
class PickleSink {
 public:
  virtual ~PickleSink() = default;
  // `items` (n of them) are being appended to `list`. True: taken — the list keeps none of them, and
  // they must not be looked at after this call. May throw an Error for items it cannot use.
  virtual bool take(const PickleDocument& doc, uint64_t list_id, const void* items, size_t n) = 0;
};

class PickleDocument {
 public:
  enum class Kind : uint8_t { none, boolean, integer, floating, string, bytes, list, tuple, dict };

  // A value of the document: copy freely; meaningful only with the document that made it.
  struct Ref {
    uint64_t bits = 0;
    bool operator==(const Ref&) const = default;
  };

  Kind kind(Ref r) const;
  bool is(Ref r, Kind k) const { return kind(r) == k; }
  // An int or a bool as an integer; nullopt for anything else.
  std::optional<int64_t> integer(Ref r) const;
  // An int, bool or float as a double; nullopt for anything else.
  std::optional<double> number(Ref r) const;
  // A str or bytes; nullopt for anything else. Valid while the document lives.
  std::optional<std::string_view> text(Ref r) const;
  // Items of a list or tuple; 0 for anything else. For a dict: its number of key/value pairs.
  uint64_t size(Ref r) const;
  // Calls f(item) for each item of a list or tuple, in order; stops when f returns false.
  template <typename F>
  void for_each(Ref container, F&& f) const;
  // Calls f(key, value) for each pair of a dict, in insertion order (a key set twice appears
  // twice; the later one is Python's value); stops when f returns false.
  template <typename F>
  void for_each_item(Ref dict, F&& f) const;
  // The value under a str key of a dict (the last one set), or nullopt.
  std::optional<Ref> get(Ref dict, std::string_view key) const;

  Ref root() const { return root_; }
  // A list's identity, as PickleSink::take names it.
  uint64_t id(Ref r) const { return r.bits; }
  // The i-th of `items` as PickleSink::take passes them.
  static Ref item(const void* items, size_t i) { return static_cast<const Ref*>(items)[i]; }
  // The bytes this document holds (its tables), for the benchmark.
  uint64_t memory_bytes() const;

 private:
  friend class PickleParser;
  struct Container {
    Kind kind;
    uint64_t size = 0;     // items (pairs count twice for a dict's references)
    uint32_t first = ~0u;  // first run in runs_
    uint32_t last = ~0u;
  };
  struct Run {
    uint64_t offset;  // into refs_
    uint32_t count;
    uint32_t next = ~0u;
  };
  struct Span {
    uint64_t block;   // of the text arena
    uint64_t offset;  // in that block
    uint64_t length;
  };
  enum Tag : uint64_t {
    kSmallInt = 0,
    kWideInt = 1,
    kConstant = 2,
    kFloat = 3,
    kString = 4,
    kBytes = 5,
    kContainer = 6,
    kUnset = 7
  };
  static Tag tag(Ref r) { return static_cast<Tag>(r.bits & 7); }
  static uint64_t index(Ref r) { return r.bits >> 3; }
  static Ref make(Tag t, uint64_t i) { return Ref{(i << 3) | t}; }
  const Container& container(Ref r) const { return containers_[index(r)]; }
  template <typename F>
  void for_each_ref(const Container& c, F&& f) const;

  Ref root_;
  std::deque<int64_t> wide_ints_;
  std::deque<double> floats_;
  std::deque<Span> spans_;
  std::vector<std::unique_ptr<char[]>> arena_;  // blocks of text
  std::vector<uint64_t> arena_sizes_;
  uint64_t arena_used_ = 0;  // in the last block
  std::deque<Container> containers_;
  std::deque<Run> runs_;
  std::deque<Ref> refs_;
};

// Reads a whole pickle from `file` (read sequentially; a pipe works). `name` is for messages.
PickleDocument read_pickle(std::FILE* file, const std::string& name, PickleSink* sink = nullptr);
// Reads the pickle in the file at `path`; a missing or unreadable file is an Error.
PickleDocument read_pickle_file(const std::string& path, PickleSink* sink = nullptr);
// Reads a pickle held in memory.
PickleDocument read_pickle_bytes(std::string_view bytes, PickleSink* sink = nullptr);

// ---- inline iteration ----

template <typename F>
void PickleDocument::for_each_ref(const Container& c, F&& f) const {
  for (uint32_t r = c.first; r != ~0u; r = runs_[r].next) {
    const Run& run = runs_[r];
    for (uint32_t i = 0; i < run.count; ++i) {
      if (!f(refs_[run.offset + i])) return;
    }
  }
}

template <typename F>
void PickleDocument::for_each(Ref container, F&& f) const {
  if (tag(container) != kContainer) return;
  const Container& c = this->container(container);
  if (c.kind == Kind::dict) return;
  for_each_ref(c, [&](Ref item) { return static_cast<bool>(f(item)); });
}

template <typename F>
void PickleDocument::for_each_item(Ref dict, F&& f) const {
  if (tag(dict) != kContainer) return;
  const Container& c = this->container(dict);
  if (c.kind != Kind::dict) return;
  bool have_key = false;
  Ref key;
  for_each_ref(c, [&](Ref item) {
    if (!have_key) {
      key = item;
      have_key = true;
      return true;
    }
    have_key = false;
    return static_cast<bool>(f(key, item));
  });
}

}  // namespace headroom
