#include "snapshot/pickle_parser.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

namespace headroom {
namespace {

constexpr uint64_t kArenaBlock = uint64_t{1} << 20;
constexpr uint32_t kNoRun = ~0u;

bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    int n;
    unsigned cp;
    if ((c & 0xE0) == 0xC0)
      n = 1, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0)
      n = 2, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0)
      n = 3, cp = c & 0x07;
    else
      return false;
    if (end - p <= n) return false;
    for (int i = 1; i <= n; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i] & 0x3F);
    }
    static constexpr unsigned kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    p += n + 1;
  }
  return true;
}

// The names of the opcodes refused by name (an unknown one has none).
const char* refused_opcode_name(uint8_t op) {
  switch (op) {
    case 'c': return "GLOBAL";
    case 0x93: return "STACK_GLOBAL";
    case 'R': return "REDUCE";
    case 'b': return "BUILD";
    case 'i': return "INST";
    case 'o': return "OBJ";
    case 0x81: return "NEWOBJ";
    case 0x92: return "NEWOBJ_EX";
    case 0x82: return "EXT1";
    case 0x83: return "EXT2";
    case 0x84: return "EXT4";
    case 'P': return "PERSID";
    case 'Q': return "BINPERSID";
    case 0x97: return "NEXT_BUFFER";
    case 0x98: return "READONLY_BUFFER";
    case 0x8f: return "EMPTY_SET";
    case 0x90: return "ADDITEMS";
    case 0x91: return "FROZENSET";
    case 'S': return "STRING";
    case 'V': return "UNICODE";
    default: return nullptr;
  }
}

}  // namespace

// ---- the dispatch loop: one line per opcode, by family ----

void PickleParser::run() {
  if (!in_.more()) throw PickleError(0, "empty input: a pickle starts with PROTO (0x80) or an opcode");
  for (uint64_t ops = 1;; ++ops) {
    at_ = in_.offset();
    if (ops % 65536 == 0) check_expansion();
    const uint8_t op = in_.byte(at_, "an opcode");
    switch (op) {
      // framing (a FRAME's length is a hint only: the opcodes inside are read as they come)
      case 0x80: protocol(); break;
      case 0x95: in_.little_endian(8, at_, "FRAME"); break;
      case '.': doc_.root_ = top("STOP"); return;
      // the stack
      case '(': mark(); break;
      case '0': pop(); break;
      case '1': stack_.resize(pop_mark()); break;  // POP_MARK
      case '2': push(top("DUP")); break;
      // scalars
      case 'N': push(D::make(D::kConstant, 0)); break;
      case 0x89: push(D::make(D::kConstant, 1)); break;  // NEWFALSE
      case 0x88: push(D::make(D::kConstant, 2)); break;  // NEWTRUE
      case 'J': push(integer(static_cast<int32_t>(in_.little_endian(4, at_, "BININT")))); break;
      case 'K': push(integer(in_.byte(at_, "BININT1"))); break;
      case 'M': push(integer(static_cast<int64_t>(in_.little_endian(2, at_, "BININT2")))); break;
      case 0x8a: push(long_bytes(in_.byte(at_, "LONG1"), "LONG1")); break;
      case 0x8b: push(long4()); break;
      case 'G': push(binfloat()); break;
      case 'I': push(text_int()); break;
      case 'L': push(text_long()); break;
      case 'F': push(text_float()); break;
      // strings and bytes
      case 'X': push(text(in_.little_endian(4, at_, "BINUNICODE"), "BINUNICODE", true)); break;
      case 0x8c: push(text(in_.byte(at_, "SHORT_BINUNICODE"), "SHORT_BINUNICODE", true)); break;
      case 0x8d: push(text(in_.little_endian(8, at_, "BINUNICODE8"), "BINUNICODE8", true)); break;
      case 'T': push(binstring()); break;
      case 'U': push(text(in_.byte(at_, "SHORT_BINSTRING"), "SHORT_BINSTRING", true)); break;
      case 'B': push(text(in_.little_endian(4, at_, "BINBYTES"), "BINBYTES", false)); break;
      case 'C': push(text(in_.byte(at_, "SHORT_BINBYTES"), "SHORT_BINBYTES", false)); break;
      case 0x8e: push(text(in_.little_endian(8, at_, "BINBYTES8"), "BINBYTES8", false)); break;
      case 0x96: push(text(in_.little_endian(8, at_, "BYTEARRAY8"), "BYTEARRAY8", false)); break;
      // containers
      case ']': push(container(Kind::list)); break;
      case ')': push(container(Kind::tuple)); break;
      case '}': push(container(Kind::dict)); break;
      case 'l': collect(Kind::list); break;
      case 't': collect(Kind::tuple); break;
      case 'd': collect(Kind::dict); break;
      case 0x85:
      case 0x86:
      case 0x87: small_tuple(op - 0x84u); break;
      case 'a': append_one(); break;
      case 'e': appends(); break;
      case 's': setitem(); break;
      case 'u': setitems(); break;
      // the memo
      case 'p': put(parse_index(in_.line(at_, "PUT", 32), "PUT")); break;
      case 'q': put(in_.byte(at_, "BINPUT")); break;
      case 'r': put(in_.little_endian(4, at_, "LONG_BINPUT")); break;
      case 0x94: put(memo_count_); break;  // MEMOIZE
      case 'g': get(parse_index(in_.line(at_, "GET", 32), "GET")); break;
      case 'h': get(in_.byte(at_, "BINGET")); break;
      case 'j': get(in_.little_endian(4, at_, "LONG_BINGET")); break;
      default: refuse(op);
    }
  }
}

// ---- framing ----

inline void PickleParser::protocol() {
  const uint8_t v = in_.byte(at_, "PROTO");
  if (v > 5) throw PickleError(at_, fmt::format("pickle protocol {}; protocols 0 to 5 are read", v));
}

// ---- the stack ----

inline void PickleParser::mark() {
  if (marks_.size() >= kMaxMarks) throw PickleError(at_, fmt::format("more than {} nested MARKs", kMaxMarks));
  marks_.push_back(
      {stack_.size(), doc_.containers_.size(), doc_.runs_.size(), doc_.refs_.size(), memo_log_.size(), ~uint64_t{0}});
}

// POP: the top value, or (as Python does) the mark when nothing is above it.
inline void PickleParser::pop() {
  if (stack_.size() > floor())
    stack_.pop_back();
  else
    pop_mark();
}

// Plain data costs a few times its pickle in memory (a snapshot about twice); a pickle built to
// expand (a byte per empty tuple, each a container) is stopped at 16 times its size read so far.
inline void PickleParser::check_expansion() const {
  const uint64_t held = doc_.memory_bytes() + stack_.size() * sizeof(Ref) + marks_.size() * sizeof(Mark) +
                        memo_.size() * sizeof(Ref) + memo_log_.size() * sizeof(uint64_t);
  if (held > 16 * at_ + (uint64_t{64} << 20)) {
    throw PickleError(at_, fmt::format("the pickle expands to {} bytes in memory, more than 16 times the {} bytes "
                                       "read: not plain data of a memory snapshot",
                                       held, at_));
  }
}

// ---- scalars ----

inline PickleDocument::Ref PickleParser::long4() {
  const auto n = static_cast<int32_t>(in_.little_endian(4, at_, "LONG4"));
  if (n < 0) throw PickleError(at_, fmt::format("LONG4 with a negative length {}", n));
  return long_bytes(static_cast<uint64_t>(n), "LONG4");
}

// Two's complement, little-endian, of n bytes.
inline PickleDocument::Ref PickleParser::long_bytes(uint64_t n, const char* what) {
  if (n > 8) {
    throw PickleError(at_, fmt::format("{} integer of {} bytes; integers up to 64 bits are read", what, n));
  }
  const uint64_t raw = in_.little_endian(static_cast<int>(n), at_, what);
  int64_t v = static_cast<int64_t>(raw);
  if (n > 0 && n < 8 && (raw >> (8 * n - 1)) & 1) v = static_cast<int64_t>(raw | (~uint64_t{0} << (8 * n)));
  return integer(v);
}

inline PickleDocument::Ref PickleParser::binfloat() {  // big-endian
  uint64_t bits = 0;
  for (int i = 0; i < 8; ++i) bits = (bits << 8) | in_.byte(at_, "BINFLOAT");
  double v;
  std::memcpy(&v, &bits, sizeof v);
  return floating(v);
}

inline PickleDocument::Ref PickleParser::text_int() {
  const std::string s = in_.line(at_, "INT", 64);
  if (s == "01" || s == "00") return D::make(D::kConstant, s == "01" ? 2 : 1);
  return integer(parse_int(s, "INT"));
}

inline PickleDocument::Ref PickleParser::text_long() {
  std::string s = in_.line(at_, "LONG", 64);
  if (!s.empty() && s.back() == 'L') s.pop_back();
  return integer(parse_int(s, "LONG"));
}

inline PickleDocument::Ref PickleParser::text_float() {
  const std::string s = in_.line(at_, "FLOAT", 64);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size())
    throw PickleError(at_, fmt::format("FLOAT argument '{}' is not a number", s));
  return floating(v);
}

inline int64_t PickleParser::parse_int(const std::string& s, const char* what) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size())
    throw PickleError(at_, fmt::format("{} argument '{}' is not an integer", what, s));
  if (errno == ERANGE) throw PickleError(at_, fmt::format("{} integer {} is wider than 64 bits", what, s));
  return v;
}

// ---- strings and bytes ----

inline PickleDocument::Ref PickleParser::binstring() {
  const auto n = static_cast<int32_t>(in_.little_endian(4, at_, "BINSTRING"));
  if (n < 0) throw PickleError(at_, fmt::format("BINSTRING with a negative length {}", n));
  return text(static_cast<uint64_t>(n), "BINSTRING", true);
}

inline PickleDocument::Ref PickleParser::text(uint64_t n, const char* what, bool unicode) {
  scratch_.clear();
  in_.take(n, scratch_, at_, what);
  if (unicode && !valid_utf8(scratch_)) throw PickleError(at_, fmt::format("{} text is not valid UTF-8", what));
  store(scratch_);
  return D::make(unicode ? D::kString : D::kBytes, doc_.spans_.size() - 1);
}

// Copies text into the document's arena, as its next span.
inline void PickleParser::store(const std::string& s) {
  if (doc_.arena_.empty() || doc_.arena_used_ + s.size() > doc_.arena_sizes_.back()) {
    const uint64_t size = std::max<uint64_t>(kArenaBlock, s.size());
    doc_.arena_.push_back(std::make_unique<char[]>(size));
    doc_.arena_sizes_.push_back(size);
    doc_.arena_used_ = 0;
  }
  std::memcpy(doc_.arena_.back().get() + doc_.arena_used_, s.data(), s.size());
  doc_.spans_.push_back({doc_.arena_.size() - 1, doc_.arena_used_, s.size()});
  doc_.arena_used_ += s.size();
}

// ---- containers ----

// LIST, TUPLE, DICT: the items above the mark.
inline void PickleParser::collect(Kind k) {
  const size_t from = pop_mark();
  if (k == Kind::dict && (stack_.size() - from) % 2 != 0)
    throw PickleError(at_, "DICT with an odd number of items (keys and values come in pairs)");
  const Ref c = container(k);
  append(c, from);
  push(c);
}

// TUPLE1, TUPLE2, TUPLE3.
inline void PickleParser::small_tuple(size_t n) {
  if (stack_.size() < n + floor()) throw PickleError(at_, fmt::format("TUPLE{} needs {} values on the stack", n, n));
  const Ref c = container(Kind::tuple);
  append(c, stack_.size() - n);
  push(c);
}

inline void PickleParser::append_one() {  // APPEND
  if (stack_.size() < 2 + floor()) throw PickleError(at_, "APPEND needs a list and a value on the stack");
  const Ref list = target(stack_.size() - 2, Kind::list, "APPEND");
  if (!offer(list, stack_.size() - 1, nullptr)) append(list, stack_.size() - 1);
}

inline void PickleParser::appends() {
  const Mark mark = pop_mark_record();
  const size_t from = mark.stack;
  if (from == 0 || from <= floor()) throw PickleError(at_, "APPENDS with no list below its mark");
  const Ref list = target(from - 1, Kind::list, "APPENDS");
  if (!offer(list, from, &mark)) append(list, from);
}

inline void PickleParser::setitem() {
  if (stack_.size() < 3 + floor()) throw PickleError(at_, "SETITEM needs a dict, a key and a value");
  append(target(stack_.size() - 3, Kind::dict, "SETITEM"), stack_.size() - 2);
}

inline void PickleParser::setitems() {
  const size_t from = pop_mark();
  if (from == 0 || from <= floor()) throw PickleError(at_, "SETITEMS with no dict below its mark");
  if ((stack_.size() - from) % 2 != 0)
    throw PickleError(at_, "SETITEMS with an odd number of items (keys and values come in pairs)");
  append(target(from - 1, Kind::dict, "SETITEMS"), from);
}

// ---- building containers ----

inline PickleDocument::Ref PickleParser::target(size_t at, Kind k, const char* what) {
  const Ref r = stack_[at];
  if (D::tag(r) != D::kContainer || doc_.containers_[D::index(r)].kind != k)
    throw PickleError(at_, fmt::format("{} onto something that is not a {}", what, k == Kind::list ? "list" : "dict"));
  return r;
}

// Moves stack_[from..] into container c, and off the stack.
inline void PickleParser::append(Ref c, size_t from) {
  if (!marks_.empty()) marks_.back().lowest_target = std::min<uint64_t>(marks_.back().lowest_target, D::index(c));
  PickleDocument::Container& box = doc_.containers_[D::index(c)];
  const uint64_t n = stack_.size() - from;
  for (uint64_t done = 0; done < n;) {
    const uint32_t k = static_cast<uint32_t>(std::min<uint64_t>(n - done, uint64_t{1} << 30));
    const uint64_t offset = doc_.refs_.size();
    for (uint32_t i = 0; i < k; ++i) doc_.refs_.push_back(stack_[from + done + i]);
    if (box.last != kNoRun && doc_.runs_[box.last].offset + doc_.runs_[box.last].count == offset &&
        doc_.runs_[box.last].count + uint64_t{k} < (uint64_t{1} << 31)) {
      doc_.runs_[box.last].count += k;  // contiguous with its last run: extend it
    } else {
      if (doc_.runs_.size() >= kNoRun) throw PickleError(at_, "more than 4 billion container runs");
      doc_.runs_.push_back({offset, k});
      const auto run = static_cast<uint32_t>(doc_.runs_.size() - 1);
      if (box.last == kNoRun)
        box.first = run;
      else
        doc_.runs_[box.last].next = run;
      box.last = run;
    }
    done += k;
  }
  box.size += n;
  stack_.resize(from);
}

// Offers stack_[from..] to the sink as items of `list`; true when it took them (and they are off
// the stack). Their memory is dropped when everything made since `mark` is those items.
inline bool PickleParser::offer(Ref list, size_t from, const Mark* mark) {
  if (!sink_) return false;
  const size_t n = stack_.size() - from;
  if (!sink_->take(doc_, list.bits, stack_.data() + from, n)) return false;
  if (mark && n == doc_.containers_.size() - mark->containers && mark->lowest_target >= mark->containers) {
    std::vector<bool> seen(n, false);
    bool only_items = true;
    for (size_t i = from; i < stack_.size() && only_items; ++i) {
      const Ref r = stack_[i];
      const uint64_t c = D::index(r);
      only_items = D::tag(r) == D::kContainer && c >= mark->containers && !seen[c - mark->containers];
      if (only_items) seen[c - mark->containers] = true;
    }
    if (only_items) forget_since(*mark);
  }
  stack_.resize(from);
  return true;
}

// Drops every container made since `mark` (the items a sink took), and their memo entries.
inline void PickleParser::forget_since(const Mark& mark) {
  size_t kept = mark.memo_log;
  for (size_t k = mark.memo_log; k < memo_log_.size(); ++k) {
    const uint64_t i = memo_log_[k];
    const Ref v = memo_[i];
    if (D::tag(v) != D::kContainer) continue;  // text and numbers stay
    if (D::index(v) >= mark.containers)
      memo_[i] = kTaken;
    else
      memo_log_[kept++] = i;  // an older container: an outer batch may still drop it
  }
  memo_log_.resize(kept);
  doc_.containers_.resize(mark.containers);
  doc_.runs_.resize(mark.runs);
  doc_.refs_.resize(mark.refs);
}

// ---- the memo ----

inline uint64_t PickleParser::parse_index(const std::string& s, const char* what) {
  const int64_t v = parse_int(s, what);
  if (v < 0) throw PickleError(at_, fmt::format("{} with a negative memo index {}", what, v));
  return static_cast<uint64_t>(v);
}

inline void PickleParser::put(uint64_t i) {
  const Ref v = top("a memo PUT");
  if (i >= memo_.size()) {
    // Each entry costs the input at least a byte: an index beyond what was read is hostile.
    if (i > in_.offset() + 256) throw PickleError(at_, fmt::format("memo index {} beyond the input read so far", i));
    memo_.resize(i + 1, D::make(D::kUnset, 0));
  }
  if (D::tag(memo_[i]) == D::kUnset && memo_[i] != kTaken) ++memo_count_;
  memo_[i] = v;
  if (D::tag(v) == D::kContainer && !marks_.empty()) memo_log_.push_back(i);
}

inline void PickleParser::get(uint64_t i) {
  if (i < memo_.size() && memo_[i] == kTaken) {
    throw PickleError(at_, fmt::format("memo GET of index {}, an item already handed over to the reader of a list "
                                       "(a trace event): not supported",
                                       i));
  }
  if (i >= memo_.size() || D::tag(memo_[i]) == D::kUnset)
    throw PickleError(at_, fmt::format("memo GET of index {}, which was never PUT", i));
  push(memo_[i]);
}

// ---- refused opcodes ----

void PickleParser::refuse(uint8_t op) {
  if (const char* name = refused_opcode_name(op)) {
    const bool code = op != 0x8f && op != 0x90 && op != 0x91 && op != 'S' && op != 'V';
    throw PickleError(at_, fmt::format("opcode {} (0x{:02x}) {}; headroom reads only plain data: None, bool, "
                                       "int, float, str, bytes, list, tuple, dict",
                                       name, op,
                                       code ? "would construct an object by name or call code, refused"
                                            : "is outside the accepted subset"));
  }
  throw PickleError(at_, fmt::format("unknown opcode 0x{:02x}; this is not a pickle, or a damaged one", op));
}

// ---- read_pickle and its siblings (snapshot/pickle_reader.h) ----
// They run the parser, and sit in its translation unit: the compiler weighs what to inline against
// the whole unit, and with them here the loop compiles as it did before the parser had a file of
// its own.

PickleDocument read_pickle(std::FILE* file, const std::string& name, PickleSink* sink) {
  PickleDocument doc;
  PickleSource in(file, {});
  try {
    PickleParser(in, doc, sink).run();
  } catch (const PickleError& e) {
    // Failing on its first opcode, the file is most likely no pickle at all: say what one looks like.
    const bool first = e.offset() == 0 && e.detail().find("protocol") == std::string::npos &&
                       e.detail().find("cannot read") == std::string::npos &&
                       e.detail().find("empty") == std::string::npos;
    throw PickleError(e.offset(),
                      first ? e.detail() + " (not a pickle? one of protocol 2 or later starts with 0x80)" : e.detail(),
                      name);
  }
  return doc;
}

PickleDocument read_pickle_file(const std::string& path, PickleSink* sink) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail("cannot open {}: {}", path, std::strerror(errno));
  struct Closer {
    std::FILE* f;
    ~Closer() { std::fclose(f); }
  } closer{f};
  return read_pickle(f, path, sink);
}

PickleDocument read_pickle_bytes(std::string_view bytes, PickleSink* sink) {
  PickleDocument doc;
  PickleSource in(nullptr, bytes);
  PickleParser(in, doc, sink).run();
  return doc;
}

}  // namespace headroom
