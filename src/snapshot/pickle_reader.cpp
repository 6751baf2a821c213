#include "snapshot/pickle_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

namespace headroom {

PickleError::PickleError(uint64_t offset, const std::string& detail, const std::string& name)
    : Error(name.empty() ? fmt::format("pickle offset {}: {}", offset, detail)
                         : fmt::format("{}: pickle offset {}: {}", name, offset, detail)),
      offset_(offset),
      detail_(detail) {}

namespace {

constexpr uint64_t kPiece = uint64_t{1} << 20;  // read size, and the largest piece read at once
constexpr uint64_t kArenaBlock = uint64_t{1} << 20;
constexpr uint32_t kNoRun = ~0u;

// The bytes of the pickle, from a file read piece by piece or from memory.
class Source {
 public:
  Source(std::FILE* file, std::string_view memory) : file_(file), data_(memory.data()), end_(memory.size()) {}

  uint64_t offset() const { return base_ + pos_; }

  // False at the end of the input.
  bool more() {
    if (pos_ < end_) return true;
    return refill();
  }
  uint8_t byte(uint64_t at, const char* what) {
    if (pos_ >= end_ && !refill()) truncated(at, what);
    return static_cast<uint8_t>(data_[pos_++]);
  }
  // Appends exactly n bytes to out, as they arrive: never reserves more than has been read.
  void take(uint64_t n, std::string& out, uint64_t at, const char* what) {
    while (n > 0) {
      if (pos_ >= end_ && !refill()) truncated(at, what);
      const uint64_t k = std::min<uint64_t>(n, end_ - pos_);
      out.append(data_ + pos_, k);
      pos_ += k;
      n -= k;
    }
  }
  uint64_t little_endian(int bytes, uint64_t at, const char* what) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(byte(at, what)) << (8 * i);
    return v;
  }
  // A text line up to '\n' (protocol 0 arguments), at most `limit` bytes.
  std::string line(uint64_t at, const char* what, size_t limit) {
    std::string s;
    for (;;) {
      const char c = static_cast<char>(byte(at, what));
      if (c == '\n') return s;
      if (s.size() >= limit) throw PickleError(at, fmt::format("{}: argument longer than {} bytes", what, limit));
      s += c;
    }
  }

 private:
  bool refill() {
    if (!file_) return false;
    buffer_.resize(kPiece);
    base_ += end_;
    pos_ = end_ = 0;
    const size_t n = std::fread(buffer_.data(), 1, buffer_.size(), file_);
    if (n == 0 && std::ferror(file_)) throw PickleError(offset(), fmt::format("cannot read: {}", std::strerror(errno)));
    data_ = buffer_.data();
    end_ = n;
    return n > 0;
  }
  [[noreturn]] void truncated(uint64_t at, const char* what) {
    throw PickleError(at, fmt::format("truncated: the input ends at byte {} inside {}", offset(), what));
  }

  std::FILE* file_;
  std::vector<char> buffer_;
  const char* data_;
  uint64_t base_ = 0, pos_ = 0, end_ = 0;
};

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

const char* opcode_name(uint8_t op) {
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

// The pickle machine (Python's Lib/pickle.py _Unpickler, restricted to plain data): a value stack
// with marks, and the memo.
class PickleParser {
 public:
  PickleParser(Source& in, PickleDocument& doc, PickleSink* sink) : in_(in), doc_(doc), sink_(sink) {}

  void run() {
    using Ref = PickleDocument::Ref;
    using Kind = PickleDocument::Kind;
    using D = PickleDocument;
    if (!in_.more()) throw PickleError(0, "empty input: a pickle starts with PROTO (0x80) or an opcode");
    for (uint64_t ops = 1;; ++ops) {
      at_ = in_.offset();
      if (ops % 65536 == 0) check_expansion();
      const uint8_t op = in_.byte(at_, "an opcode");
      switch (op) {
        case 0x80: {  // PROTO
          const uint8_t v = in_.byte(at_, "PROTO");
          if (v > 5) throw PickleError(at_, fmt::format("pickle protocol {}; protocols 0 to 5 are read", v));
          break;
        }
        case 0x95:  // FRAME: a length hint only; the opcodes inside are read as they come
          in_.little_endian(8, at_, "FRAME");
          break;
        case '.':  // STOP
          doc_.root_ = top("STOP");
          return;
        case '(':
          if (marks_.size() >= kMaxMarks) throw PickleError(at_, fmt::format("more than {} nested MARKs", kMaxMarks));
          marks_.push_back({stack_.size(), doc_.containers_.size(), doc_.runs_.size(), doc_.refs_.size(),
                            memo_log_.size(), ~uint64_t{0}});
          break;
        case '0':  // POP: the top value, or (as Python does) the mark when nothing is above it
          if (stack_.size() > floor())
            stack_.pop_back();
          else
            pop_mark();
          break;
        case '1':  // POP_MARK
          stack_.resize(pop_mark());
          break;
        case '2':  // DUP
          push(top("DUP"));
          break;
        case 'N': push(D::make(D::kConstant, 0)); break;
        case 0x89: push(D::make(D::kConstant, 1)); break;
        case 0x88: push(D::make(D::kConstant, 2)); break;
        case 'J': push(integer(static_cast<int32_t>(in_.little_endian(4, at_, "BININT")))); break;
        case 'K': push(integer(in_.byte(at_, "BININT1"))); break;
        case 'M': push(integer(static_cast<int64_t>(in_.little_endian(2, at_, "BININT2")))); break;
        case 0x8a: push(long_bytes(in_.byte(at_, "LONG1"), "LONG1")); break;
        case 0x8b: {
          const auto n = static_cast<int32_t>(in_.little_endian(4, at_, "LONG4"));
          if (n < 0) throw PickleError(at_, fmt::format("LONG4 with a negative length {}", n));
          push(long_bytes(static_cast<uint64_t>(n), "LONG4"));
          break;
        }
        case 'I': {
          const std::string s = in_.line(at_, "INT", 64);
          if (s == "01" || s == "00")
            push(D::make(D::kConstant, s == "01" ? 2 : 1));
          else
            push(integer(parse_int(s, "INT")));
          break;
        }
        case 'L': {
          std::string s = in_.line(at_, "LONG", 64);
          if (!s.empty() && s.back() == 'L') s.pop_back();
          push(integer(parse_int(s, "LONG")));
          break;
        }
        case 'F': {
          const std::string s = in_.line(at_, "FLOAT", 64);
          char* end = nullptr;
          const double v = std::strtod(s.c_str(), &end);
          if (s.empty() || end != s.c_str() + s.size())
            throw PickleError(at_, fmt::format("FLOAT argument '{}' is not a number", s));
          push(floating(v));
          break;
        }
        case 'G': {
          uint64_t bits = 0;
          for (int i = 0; i < 8; ++i) bits = (bits << 8) | in_.byte(at_, "BINFLOAT");
          double v;
          std::memcpy(&v, &bits, sizeof v);
          push(floating(v));
          break;
        }
        case 'X': push(text(in_.little_endian(4, at_, "BINUNICODE"), "BINUNICODE", true)); break;
        case 0x8c: push(text(in_.byte(at_, "SHORT_BINUNICODE"), "SHORT_BINUNICODE", true)); break;
        case 0x8d: push(text(in_.little_endian(8, at_, "BINUNICODE8"), "BINUNICODE8", true)); break;
        case 'T': {
          const auto n = static_cast<int32_t>(in_.little_endian(4, at_, "BINSTRING"));
          if (n < 0) throw PickleError(at_, fmt::format("BINSTRING with a negative length {}", n));
          push(text(static_cast<uint64_t>(n), "BINSTRING", true));
          break;
        }
        case 'U': push(text(in_.byte(at_, "SHORT_BINSTRING"), "SHORT_BINSTRING", true)); break;
        case 'B': push(text(in_.little_endian(4, at_, "BINBYTES"), "BINBYTES", false)); break;
        case 'C': push(text(in_.byte(at_, "SHORT_BINBYTES"), "SHORT_BINBYTES", false)); break;
        case 0x8e: push(text(in_.little_endian(8, at_, "BINBYTES8"), "BINBYTES8", false)); break;
        case 0x96: push(text(in_.little_endian(8, at_, "BYTEARRAY8"), "BYTEARRAY8", false)); break;
        case ']': push(container(Kind::list)); break;
        case ')': push(container(Kind::tuple)); break;
        case '}': push(container(Kind::dict)); break;
        case 'l':
        case 't':
        case 'd': {
          const Kind k = op == 'l' ? Kind::list : op == 't' ? Kind::tuple : Kind::dict;
          const size_t from = pop_mark();
          if (k == Kind::dict && (stack_.size() - from) % 2 != 0)
            throw PickleError(at_, "DICT with an odd number of items (keys and values come in pairs)");
          const Ref c = container(k);
          append(c, from);
          push(c);
          break;
        }
        case 0x85:
        case 0x86:
        case 0x87: {
          const size_t n = op - 0x84u;
          if (stack_.size() < n + floor())
            throw PickleError(at_, fmt::format("TUPLE{} needs {} values on the stack", n, n));
          const Ref c = container(Kind::tuple);
          append(c, stack_.size() - n);
          push(c);
          break;
        }
        case 'a': {  // APPEND
          if (stack_.size() < 2 + floor()) throw PickleError(at_, "APPEND needs a list and a value on the stack");
          const Ref list = target(stack_.size() - 2, Kind::list, "APPEND");
          if (!offer(list, stack_.size() - 1, nullptr)) append(list, stack_.size() - 1);
          break;
        }
        case 'e': {  // APPENDS
          const Mark mark = pop_mark_record();
          const size_t from = mark.stack;
          if (from == 0 || from <= floor()) throw PickleError(at_, "APPENDS with no list below its mark");
          const Ref list = target(from - 1, Kind::list, "APPENDS");
          if (!offer(list, from, &mark)) append(list, from);
          break;
        }
        case 's': {  // SETITEM
          if (stack_.size() < 3 + floor()) throw PickleError(at_, "SETITEM needs a dict, a key and a value");
          append(target(stack_.size() - 3, Kind::dict, "SETITEM"), stack_.size() - 2);
          break;
        }
        case 'u': {  // SETITEMS
          const size_t from = pop_mark();
          if (from == 0 || from <= floor()) throw PickleError(at_, "SETITEMS with no dict below its mark");
          if ((stack_.size() - from) % 2 != 0)
            throw PickleError(at_, "SETITEMS with an odd number of items (keys and values come in pairs)");
          append(target(from - 1, Kind::dict, "SETITEMS"), from);
          break;
        }
        case 'p': put(parse_index(in_.line(at_, "PUT", 32), "PUT")); break;
        case 'q': put(in_.byte(at_, "BINPUT")); break;
        case 'r': put(in_.little_endian(4, at_, "LONG_BINPUT")); break;
        case 0x94: put(memo_count_); break;  // MEMOIZE
        case 'g': get(parse_index(in_.line(at_, "GET", 32), "GET")); break;
        case 'h': get(in_.byte(at_, "BINGET")); break;
        case 'j': get(in_.little_endian(4, at_, "LONG_BINGET")); break;
        default: {
          if (const char* name = opcode_name(op)) {
            const bool code = op != 0x8f && op != 0x90 && op != 0x91 && op != 'S' && op != 'V';
            throw PickleError(at_, fmt::format("opcode {} (0x{:02x}) {}; headroom reads only plain data: None, bool, "
                                               "int, float, str, bytes, list, tuple, dict",
                                               name, op,
                                               code ? "would construct an object by name or call code, refused"
                                                    : "is outside the accepted subset"));
          }
          throw PickleError(at_, fmt::format("unknown opcode 0x{:02x}; this is not a pickle, or a damaged one", op));
        }
      }
    }
  }

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

  size_t floor() const { return marks_.empty() ? 0 : marks_.back().stack; }

  // Plain data costs a few times its pickle in memory (a snapshot about twice); a pickle built to
  // expand (a byte per empty tuple, each a container) is stopped at 16 times its size read so far.
  void check_expansion() const {
    const uint64_t held = doc_.memory_bytes() + stack_.size() * sizeof(Ref) + marks_.size() * sizeof(Mark) +
                          memo_.size() * sizeof(Ref) + memo_log_.size() * sizeof(uint64_t);
    if (held > 16 * at_ + (uint64_t{64} << 20)) {
      throw PickleError(at_, fmt::format("the pickle expands to {} bytes in memory, more than 16 times the {} bytes "
                                         "read: not plain data of a memory snapshot",
                                         held, at_));
    }
  }
  void push(Ref r) { stack_.push_back(r); }
  Ref top(const char* what) {
    if (stack_.size() <= floor()) throw PickleError(at_, fmt::format("{} with nothing on the stack", what));
    return stack_.back();
  }
  size_t pop_mark() { return pop_mark_record().stack; }
  Mark pop_mark_record() {
    if (marks_.empty()) throw PickleError(at_, "no MARK on the stack for this opcode");
    const Mark m = marks_.back();
    marks_.pop_back();
    if (!marks_.empty()) marks_.back().lowest_target = std::min(marks_.back().lowest_target, m.lowest_target);
    return m;
  }

  // Offers stack_[from..] to the sink as items of `list`; true when it took them (and they are off
  // the stack). Their memory is dropped when everything made since `mark` is those items.
  bool offer(Ref list, size_t from, const Mark* mark) {
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
  void forget_since(const Mark& mark) {
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
  // Two's complement, little-endian, of n bytes.
  Ref long_bytes(uint64_t n, const char* what) {
    if (n > 8) {
      throw PickleError(at_, fmt::format("{} integer of {} bytes; integers up to 64 bits are read", what, n));
    }
    const uint64_t raw = in_.little_endian(static_cast<int>(n), at_, what);
    int64_t v = static_cast<int64_t>(raw);
    if (n > 0 && n < 8 && (raw >> (8 * n - 1)) & 1) v = static_cast<int64_t>(raw | (~uint64_t{0} << (8 * n)));
    return integer(v);
  }
  int64_t parse_int(const std::string& s, const char* what) {
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || end != s.c_str() + s.size())
      throw PickleError(at_, fmt::format("{} argument '{}' is not an integer", what, s));
    if (errno == ERANGE) throw PickleError(at_, fmt::format("{} integer {} is wider than 64 bits", what, s));
    return v;
  }
  uint64_t parse_index(const std::string& s, const char* what) {
    const int64_t v = parse_int(s, what);
    if (v < 0) throw PickleError(at_, fmt::format("{} with a negative memo index {}", what, v));
    return static_cast<uint64_t>(v);
  }
  Ref text(uint64_t n, const char* what, bool unicode) {
    scratch_.clear();
    in_.take(n, scratch_, at_, what);
    if (unicode && !valid_utf8(scratch_)) throw PickleError(at_, fmt::format("{} text is not valid UTF-8", what));
    store(scratch_);
    return D::make(unicode ? D::kString : D::kBytes, doc_.spans_.size() - 1);
  }
  // Copies text into the document's arena, as its next span.
  void store(const std::string& s) {
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
  Ref container(Kind k) {
    doc_.containers_.push_back({k});
    return D::make(D::kContainer, doc_.containers_.size() - 1);
  }
  Ref target(size_t at, Kind k, const char* what) {
    const Ref r = stack_[at];
    if (D::tag(r) != D::kContainer || doc_.containers_[D::index(r)].kind != k)
      throw PickleError(at_,
                        fmt::format("{} onto something that is not a {}", what, k == Kind::list ? "list" : "dict"));
    return r;
  }
  // Moves stack_[from..] into container c, and off the stack.
  void append(Ref c, size_t from) {
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
  void put(uint64_t i) {
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
  void get(uint64_t i) {
    if (i < memo_.size() && memo_[i] == kTaken) {
      throw PickleError(at_, fmt::format("memo GET of index {}, an item already handed over to the reader of a list "
                                         "(a trace event): not supported",
                                         i));
    }
    if (i >= memo_.size() || D::tag(memo_[i]) == D::kUnset)
      throw PickleError(at_, fmt::format("memo GET of index {}, which was never PUT", i));
    push(memo_[i]);
  }

  static constexpr Ref kTaken = Ref{(uint64_t{1} << 3) | D::kUnset};
  static constexpr size_t kMaxMarks = 100'000;  // snapshots nest a handful

  Source& in_;
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

PickleDocument::Kind PickleDocument::kind(Ref r) const {
  switch (tag(r)) {
    case kSmallInt:
    case kWideInt: return Kind::integer;
    case kConstant: return index(r) == 0 ? Kind::none : Kind::boolean;
    case kFloat: return Kind::floating;
    case kString: return Kind::string;
    case kBytes: return Kind::bytes;
    case kContainer: return containers_[index(r)].kind;
    default: return Kind::none;
  }
}

std::optional<int64_t> PickleDocument::integer(Ref r) const {
  switch (tag(r)) {
    case kSmallInt: {
      // 61 bits stored; sign-extend.
      const uint64_t v = index(r);
      return static_cast<int64_t>(v << 3) >> 3;
    }
    case kWideInt: return wide_ints_[index(r)];
    case kConstant:
      if (index(r) == 0) return std::nullopt;
      return index(r) == 2 ? 1 : 0;
    default: return std::nullopt;
  }
}

std::optional<double> PickleDocument::number(Ref r) const {
  if (tag(r) == kFloat) return floats_[index(r)];
  if (const auto i = integer(r)) return static_cast<double>(*i);
  return std::nullopt;
}

std::optional<std::string_view> PickleDocument::text(Ref r) const {
  if (tag(r) != kString && tag(r) != kBytes) return std::nullopt;
  const Span& s = spans_[index(r)];
  return std::string_view(arena_[s.block].get() + s.offset, s.length);
}

uint64_t PickleDocument::size(Ref r) const {
  if (tag(r) != kContainer) return 0;
  const Container& c = container(r);
  return c.kind == Kind::dict ? c.size / 2 : c.size;
}

std::optional<PickleDocument::Ref> PickleDocument::get(Ref dict, std::string_view key) const {
  std::optional<Ref> found;
  for_each_item(dict, [&](Ref k, Ref v) {
    if (const auto t = text(k); t && tag(k) == kString && *t == key) found = v;
    return true;
  });
  return found;
}

uint64_t PickleDocument::memory_bytes() const {
  uint64_t arena = 0;
  for (uint64_t s : arena_sizes_) arena += s;
  return arena + wide_ints_.size() * 8 + floats_.size() * 8 + spans_.size() * sizeof(Span) +
         containers_.size() * sizeof(Container) + runs_.size() * sizeof(Run) + refs_.size() * sizeof(Ref);
}

PickleDocument read_pickle(std::FILE* file, const std::string& name, PickleSink* sink) {
  PickleDocument doc;
  Source in(file, {});
  try {
    PickleParser(in, doc, sink).run();
  } catch (const PickleError& e) {
    // Failing on its first opcode, the file is most likely no pickle at all: say what one looks like.
    const bool first = e.offset() == 0 && e.detail().find("protocol") == std::string::npos &&
                       e.detail().find("cannot read") == std::string::npos && e.detail().find("empty") == std::string::npos;
    throw PickleError(e.offset(), first ? e.detail() + " (not a pickle? one of protocol 2 or later starts with 0x80)" : e.detail(),
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
  Source in(nullptr, bytes);
  PickleParser(in, doc, sink).run();
  return doc;
}

}  // namespace headroom
