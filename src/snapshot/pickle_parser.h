// PickleParser — the pickle machine behind read_pickle (snapshot/pickle_reader.h): Python's
// Lib/pickle.py _Unpickler restricted to plain data, a value stack with marks and the memo, building
// a PickleDocument as it goes. run() is one loop over the opcodes with an explicit stack (no
// recursion), a switch of one line per opcode into the handlers of its family: framing (PROTO,
// FRAME, STOP), the stack (MARK, POP, POP_MARK, DUP), scalars (None, bool, int, float), strings and
// bytes, containers (made, and filled: a list's items are offered to the PickleSink), the memo, and
// the refused opcodes. Every bound of pickle_reader.h is enforced here: marks nest 100,000 deep
// at most, the memo grows only as far as the input could have filled it, and memory stays under 16
// times the input read (plus 64 MiB). Any violation is a PickleError at the opcode's offset.
// Private to pickle_parser.cpp, which holds read_pickle and its siblings too; one parser reads one
// pickle.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "snapshot/pickle_reader.h"
#include "snapshot/pickle_source.h"

namespace headroom {

class PickleParser {
 public:
  PickleParser(PickleSource& in, PickleDocument& doc, PickleSink* sink) : in_(in), doc_(doc), sink_(sink) {}

  // Reads opcodes up to STOP, whose value becomes the document's root.
  void run();

 private:
  using Ref = PickleDocument::Ref;
  using Kind = PickleDocument::Kind;
  using D = PickleDocument;

  // A MARK, and the document's size when it was pushed: what a batch appended after it made.
  struct Mark {
    size_t stack;
    uint64_t containers, runs, refs, memo_log;
    uint64_t lowest_target;  // the oldest container appended to since (containers are numbered in order)
  };

  // Every member below but refuse() is inline, defined in pickle_parser.cpp (its only user), and the
  // handlers that are run()'s case bodies always inline: the compiler makes of run() the one loop it
  // made when they were written in its switch (the same instructions; 1 GB snapshots stream through).

  // ---- framing ----
  [[gnu::always_inline]] inline void protocol();  // PROTO

  // ---- the stack and its marks ----
  size_t floor() const { return marks_.empty() ? 0 : marks_.back().stack; }
  void push(Ref r) { stack_.push_back(r); }
  Ref top(const char* what) {
    if (stack_.size() <= floor()) throw PickleError(at_, fmt::format("{} with nothing on the stack", what));
    return stack_.back();
  }
  [[gnu::always_inline]] inline void mark();  // MARK
  [[gnu::always_inline]] inline void pop();   // POP
  size_t pop_mark() { return pop_mark_record().stack; }
  Mark pop_mark_record() {
    if (marks_.empty()) throw PickleError(at_, "no MARK on the stack for this opcode");
    const Mark m = marks_.back();
    marks_.pop_back();
    if (!marks_.empty()) marks_.back().lowest_target = std::min(marks_.back().lowest_target, m.lowest_target);
    return m;
  }
  inline void check_expansion() const;

  // ---- scalars ----
  Ref integer(int64_t v) {
    constexpr int64_t kInline = int64_t{1} << 59;
    if (v >= -kInline && v < kInline)
      return D::make(D::kSmallInt, static_cast<uint64_t>(v) & ((uint64_t{1} << 61) - 1));
    doc_.wide_ints_.push_back(v);
    return D::make(D::kWideInt, doc_.wide_ints_.size() - 1);
  }
  Ref floating(double v) {
    doc_.floats_.push_back(v);
    return D::make(D::kFloat, doc_.floats_.size() - 1);
  }
  [[gnu::always_inline]] inline Ref long4();            // LONG4
  inline Ref long_bytes(uint64_t n, const char* what);  // LONG1, LONG4
  [[gnu::always_inline]] inline Ref binfloat();         // BINFLOAT
  [[gnu::always_inline]] inline Ref text_int();         // INT (protocol 0, as a line of text; also bools)
  [[gnu::always_inline]] inline Ref text_long();        // LONG (protocol 0)
  [[gnu::always_inline]] inline Ref text_float();       // FLOAT (protocol 0)
  inline int64_t parse_int(const std::string& s, const char* what);

  // ---- strings and bytes ----
  [[gnu::always_inline]] inline Ref binstring();  // BINSTRING
  // The next n bytes as a str (checked to be UTF-8) or bytes.
  inline Ref text(uint64_t n, const char* what, bool unicode);
  inline void store(const std::string& s);

  // ---- containers ----
  Ref container(Kind k) {
    doc_.containers_.push_back({k});
    return D::make(D::kContainer, doc_.containers_.size() - 1);
  }
  [[gnu::always_inline]] inline void collect(Kind k);        // LIST TUPLE DICT
  [[gnu::always_inline]] inline void small_tuple(size_t n);  // TUPLE1 TUPLE2 TUPLE3
  [[gnu::always_inline]] inline void append_one();           // APPEND
  [[gnu::always_inline]] inline void appends();              // APPENDS
  [[gnu::always_inline]] inline void setitem();              // SETITEM
  [[gnu::always_inline]] inline void setitems();             // SETITEMS
  inline Ref target(size_t at, Kind k, const char* what);
  inline void append(Ref c, size_t from);
  inline bool offer(Ref list, size_t from, const Mark* mark);
  inline void forget_since(const Mark& mark);

  // ---- the memo ----
  inline uint64_t parse_index(const std::string& s, const char* what);
  inline void put(uint64_t i);
  inline void get(uint64_t i);

  // ---- refused opcodes: code, objects by name, sets, protocol-0 text strings, unknown bytes ----
  [[noreturn]] void refuse(uint8_t op);

  static constexpr Ref kTaken = Ref{(uint64_t{1} << 3) | D::kUnset};
  static constexpr size_t kMaxMarks = 100'000;  // snapshots nest a handful

  PickleSource& in_;
  PickleDocument& doc_;
  PickleSink* sink_;
  std::vector<Ref> stack_;
  std::vector<Mark> marks_;
  std::vector<Ref> memo_;
  std::vector<uint64_t> memo_log_;  // memo indices set to containers, while a mark is open
  uint64_t memo_count_ = 0;
  uint64_t at_ = 0;
  std::string scratch_;
};

}  // namespace headroom
