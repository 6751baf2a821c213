// The pickle reader against pickles written by Python's own pickle module (every protocol), against
// pickles written by hand byte by byte, and against hostile ones: code-constructing opcodes, every
// truncation of a file, lengths and memo indices far beyond the input.
#include "snapshot/pickle_reader.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "testing/command.h"
#include "testing/temp_dir.h"

namespace headroom {
namespace {

using testing::run_command;
using testing::TempDir;
using Kind = PickleDocument::Kind;
using Ref = PickleDocument::Ref;
using namespace std::string_literals;

// The value every protocol writes (the test below checks it field by field, by hand).
constexpr const char* kValue = R"(
shared = {'filename': 'train.py', 'line': 42, 'name': 'forward'}
# Before protocol 3, Python writes bytes as a call (_codecs.encode): refused, as every call is.
value = {
    'none': None, 'yes': True, 'no': False,
    'ints': [0, 1, 255, 256, 65535, 65536, -1, 2**31 - 1, -2**31, 2**40, -2**40, 2**62, 2**63 - 1, -2**63],
    'float': -2.5, 'text': 'héllo ✓', 'bytes': b'\x00\xff' if P >= 3 else None, 'empty': '',
    'tuple': (1, 'two', (3,)), 'frames': [shared, shared], 'nested': {'a': {'b': [[], {}]}},
}
)";

std::string python_pickle(const TempDir& dir, int protocol, const std::string& value_code = kValue) {
  const std::string script = dir.file("write.py"), out = dir.file("p" + std::to_string(protocol) + ".pickle");
  std::ofstream(script) << "import pickle, sys\nP = " << protocol << "\n"
                        << value_code << "\nwith open(sys.argv[1], 'wb') as f:\n"
                        << "    pickle.dump(value, f, protocol=" << protocol << ")\n";
  const auto r = run_command(std::string(HEADROOM_PYTHON) + " " + script + " " + out + " 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  return out;
}

std::string bytes_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

int64_t int_at(const PickleDocument& d, Ref list, size_t i) {
  size_t k = 0;
  int64_t out = 0;
  d.for_each(list, [&](Ref r) {
    if (k++ == i) out = d.integer(r).value();
    return k <= i;
  });
  return out;
}

class PythonProtocols : public ::testing::TestWithParam<int> {};

TEST_P(PythonProtocols, ReadsEveryPlainValueAsPythonWroteIt) {
  TempDir dir;
  const PickleDocument d = read_pickle_file(python_pickle(dir, GetParam()));
  const Ref root = d.root();
  ASSERT_EQ(d.kind(root), Kind::dict);
  EXPECT_EQ(d.size(root), 11u);
  EXPECT_EQ(d.kind(*d.get(root, "none")), Kind::none);
  EXPECT_EQ(d.kind(*d.get(root, "yes")), Kind::boolean);
  EXPECT_EQ(d.integer(*d.get(root, "yes")), 1);
  EXPECT_EQ(d.integer(*d.get(root, "no")), 0);
  const Ref ints = *d.get(root, "ints");
  const std::vector<int64_t> want = {0,
                                     1,
                                     255,
                                     256,
                                     65535,
                                     65536,
                                     -1,
                                     2147483647,
                                     -2147483648,
                                     int64_t{1} << 40,
                                     -(int64_t{1} << 40),
                                     int64_t{1} << 62,
                                     INT64_MAX,
                                     INT64_MIN};
  ASSERT_EQ(d.size(ints), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(int_at(d, ints, i), want[i]) << "ints[" << i << "]";
  EXPECT_EQ(d.number(*d.get(root, "float")), -2.5);
  EXPECT_EQ(d.text(*d.get(root, "text")), "h\xc3\xa9llo \xe2\x9c\x93");
  if (GetParam() >= 3) {
    EXPECT_EQ(d.kind(*d.get(root, "bytes")), Kind::bytes);
    EXPECT_EQ(d.text(*d.get(root, "bytes")), "\x00\xff"s);
  }
  EXPECT_EQ(d.text(*d.get(root, "empty")), "");
  const Ref tuple = *d.get(root, "tuple");
  ASSERT_EQ(d.kind(tuple), Kind::tuple);
  EXPECT_EQ(d.size(tuple), 3u);
  const Ref frames = *d.get(root, "frames");
  ASSERT_EQ(d.size(frames), 2u);
  std::vector<Ref> both;
  d.for_each(frames, [&](Ref f) {
    both.push_back(f);
    return true;
  });
  EXPECT_EQ(d.text(*d.get(both[1], "filename")), "train.py");
  EXPECT_EQ(d.integer(*d.get(both[1], "line")), 42);
  if (GetParam() >= 1) {
    EXPECT_EQ(both[0], both[1]) << "the memo shares one dict, as Python's pickle does";
  }
  const Ref nested = *d.get(*d.get(*d.get(root, "nested"), "a"), "b");
  EXPECT_EQ(d.size(nested), 2u);
  EXPECT_FALSE(d.get(root, "missing"));
}

INSTANTIATE_TEST_SUITE_P(Pickle, PythonProtocols, ::testing::Values(1, 2, 3, 4, 5));

TEST(PickleReader, ProtocolZeroNumbersListsAndTheTextMemo) {
  TempDir dir;
  const PickleDocument d = read_pickle_file(
      python_pickle(dir, 0, "x = [1, 2]\nvalue = [7, 2**40, -3, 1.5, None, True, False, (4, 5), x, x]\n"));
  ASSERT_EQ(d.size(d.root()), 10u);
  EXPECT_EQ(int_at(d, d.root(), 0), 7);
  EXPECT_EQ(int_at(d, d.root(), 1), int64_t{1} << 40);
  EXPECT_EQ(int_at(d, d.root(), 2), -3);
  EXPECT_EQ(int_at(d, d.root(), 5), 1);
  EXPECT_EQ(int_at(d, d.root(), 6), 0);
}

// The one-line message a file is refused with ("" if it is read).
std::string refusal(const std::string& path) {
  try {
    read_pickle_file(path);
  } catch (const PickleError& e) {
    return e.what();
  }
  return "";
}

TEST(PickleReader, BytesBeforeProtocolThreeAreACallAndRefused) {
  TempDir dir;
  EXPECT_NE(refusal(python_pickle(dir, 2, "value = [b'x']\n")).find("GLOBAL"), std::string::npos);
}

TEST(PickleReader, ProtocolZeroTextStringsAreOutsideTheSubset) {
  TempDir dir;
  EXPECT_NE(refusal(python_pickle(dir, 0, "value = ['a']\n")).find("UNICODE"), std::string::npos);
}

// Byte by byte, as pickletools documents the opcodes.
TEST(PickleReader, HandWrittenPickles) {
  // [1, 2] at protocol 2: PROTO 2, EMPTY_LIST, BINPUT 0, MARK, BININT1 1, BININT1 2, APPENDS, STOP.
  const PickleDocument a = read_pickle_bytes(
      "\x80\x02]q\x00(K\x01K\x02"
      "e."s);
  ASSERT_EQ(a.size(a.root()), 2u);
  EXPECT_EQ(int_at(a, a.root(), 1), 2);
  // {'k': -2**40} via LONG1 (6 bytes, two's complement, little-endian): 00 00 00 00 00 ff... = -2^40.
  const PickleDocument b = read_pickle_bytes(
      "\x80\x04}\x8c\x01k\x8a\x06\x00\x00\x00\x00\x00\xff"
      "s."s);
  EXPECT_EQ(b.integer(*b.get(b.root(), "k")), -(int64_t{1} << 40));
  // A list that holds itself (memo GET of the list being built): read, not followed.
  const PickleDocument c = read_pickle_bytes(
      "\x80\x02]q\x00h\x00"
      "a."s);
  Ref inner;
  c.for_each(c.root(), [&](Ref r) {
    inner = r;
    return true;
  });
  EXPECT_EQ(inner, c.root());
  // POP_MARK and DUP: MARK, 1, 2, POP_MARK, NONE, DUP, TUPLE2 -> (None, None).
  const PickleDocument d = read_pickle_bytes(
      "(K\x01K\x02"
      "1N2\x86."s);
  EXPECT_EQ(d.size(d.root()), 2u);
}

void expect_refused(const std::string& bytes, const std::string& needle, uint64_t offset) {
  try {
    read_pickle_bytes(bytes);
    FAIL() << "accepted; expected an error containing '" << needle << "'";
  } catch (const PickleError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_EQ(e.offset(), offset) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one line";
  }
}

TEST(PickleReader, RefusesEveryOpcodeThatConstructsObjectsOrCallsCode) {
  // os.system('ls') as pickle.dumps writes it at protocol 2: GLOBAL at offset 2.
  expect_refused(
      "\x80\x02"
      "cposix\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03."s,
      "GLOBAL (0x63)", 2);
  expect_refused("\x80\x04\x8c\x02os\x8c\x06system\x93."s, "STACK_GLOBAL", 14);
  expect_refused("\x80\x02N)R."s, "REDUCE", 4);
  expect_refused("\x80\x02}}b."s, "BUILD", 4);
  expect_refused("\x80\x02(i__main__\nX\n."s, "INST", 3);
  expect_refused("\x80\x02(o."s, "OBJ", 3);
  expect_refused("\x80\x02N)\x81."s, "NEWOBJ", 4);
  expect_refused("\x80\x02\x82\x01."s, "EXT1", 2);
  expect_refused("\x80\x02Pid\n."s, "PERSID", 2);
  expect_refused("\x80\x02NQ."s, "BINPERSID", 3);
  expect_refused("\x80\x05\x97."s, "NEXT_BUFFER", 2);
  expect_refused("\x80\x04\x8f."s, "EMPTY_SET", 2);
  expect_refused("\x80\x02\xff."s, "unknown opcode 0xff", 2);
  expect_refused("\x80\x06N."s, "protocol 6", 0);
}

TEST(PickleReader, DeclaredLengthsAndIndicesBeyondTheInputFailWithoutAllocatingThem) {
  // BINUNICODE8 of 2^60 bytes, BINBYTES8 of 2^62, LONG4 of 2^31-1 bytes, LONG_BINPUT 2^32-1, LONG_BINGET.
  expect_refused(
      "\x80\x04\x8d\x00\x00\x00\x00\x00\x00\x00\x10"
      "abc"s,
      "truncated", 2);
  expect_refused(
      "\x80\x04\x8e\x00\x00\x00\x00\x00\x00\x00\x40"
      "abc"s,
      "truncated", 2);
  expect_refused(
      "\x80\x02\x8b\xff\xff\xff\x7f"
      "abc"s,
      "integers up to 64 bits", 2);
  expect_refused("\x80\x02Nr\xff\xff\xff\xff."s, "memo index 4294967295", 3);
  expect_refused("\x80\x02j\x00\x00\x00\x01."s, "never PUT", 2);
  // A FRAME's length is a hint: a huge one is harmless.
  const PickleDocument d = read_pickle_bytes("\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\x7fN."s);
  EXPECT_EQ(d.kind(d.root()), Kind::none);
}

TEST(PickleReader, StackAndMarkMisuseAreErrors) {
  expect_refused("\x80\x02."s, "STOP with nothing on the stack", 2);
  expect_refused(
      "\x80\x02"
      "e."s,
      "no MARK", 2);
  expect_refused("\x80\x02(e."s, "APPENDS with no list", 3);
  expect_refused(
      "\x80\x02K\x01(K\x02"
      "e."s,
      "not a list", 7);
  expect_refused("\x80\x02}(K\x01u."s, "odd number", 6);
  expect_refused("\x80\x02X\x02\x00\x00\x00\xc3(."s, "not valid UTF-8", 2);
  expect_refused("", "empty input", 0);
}

TEST(PickleReader, EveryTruncationOfAPythonPickleIsAnError) {
  TempDir dir;
  const std::string whole = bytes_of(python_pickle(dir, 4));
  ASSERT_GT(whole.size(), 100u);
  for (size_t n = 0; n + 1 < whole.size(); ++n) {
    EXPECT_THROW(read_pickle_bytes(std::string_view(whole).substr(0, n)), PickleError) << "cut at " << n;
  }
  EXPECT_NO_THROW(read_pickle_bytes(whole));
}

TEST(PickleReader, AMissingFileIsAnErrorNamingIt) {
  try {
    read_pickle_file("/nonexistent/snap.pickle");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/snap.pickle"), std::string::npos) << e.what();
  }
}

// A million memo references to one string cost their references, not a million strings.
TEST(PickleReader, SharedValuesAreStoredOnce) {
  std::string p = "\x80\x02]q\x00(X\x05\x00\x00\x00helloq\x01"s;
  for (int i = 0; i < 1'000'000; ++i) p += "h\x01"s;
  p += "e.";
  const PickleDocument d = read_pickle_bytes(p);
  EXPECT_EQ(d.size(d.root()), 1'000'001u);
  EXPECT_LT(d.memory_bytes(), uint64_t{12} << 20);  // 8 MB of references, one 1 MiB text block
}

// A sink that takes lists of dicts: the document keeps none of their items, and drops the memory of
// every batch that made nothing else; a later memo reference to a taken item is an error.
struct TakeDicts : PickleSink {
  uint64_t taken = 0;
  bool take(const PickleDocument& doc, uint64_t, const void* items, size_t n) override {
    if (!doc.is(PickleDocument::item(items, 0), Kind::dict)) return false;
    for (size_t i = 0; i < n; ++i) taken += doc.integer(*doc.get(PickleDocument::item(items, i), "k")).value();
    return true;
  }
};

TEST(PickleReader, ASinkTakesListItemsAsTheyAreReadAndTheirMemoryGoes) {
  TempDir dir;
  const std::string path =
      python_pickle(dir, 4, "value = {'events': [{'k': i, 'x': 'same'} for i in range(100000)], 'tail': [1, 2]}\n");
  TakeDicts sink;
  const PickleDocument d = read_pickle_file(path, &sink);
  EXPECT_EQ(sink.taken, uint64_t{100000} * 99999 / 2);
  EXPECT_EQ(d.size(*d.get(d.root(), "events")), 0u);
  EXPECT_EQ(d.size(*d.get(d.root(), "tail")), 2u);  // a list of ints: not taken
  const PickleDocument whole = read_pickle_file(path);
  EXPECT_EQ(whole.size(*whole.get(whole.root(), "events")), 100000u);
  // Whole: 100,000 dicts of 24 + 16 + 4 x 8 bytes, and the list's references; taken: the text block.
  EXPECT_GT(whole.memory_bytes(), uint64_t{8'000'000});
  EXPECT_LT(d.memory_bytes(), (uint64_t{1} << 20) + 4096);
  // The same dict again in a later batch: its first appearance was dropped with its batch.
  const std::string again =
      python_pickle(dir, 4, "e = {'k': 1}\nvalue = [e] + [{'k': 0} for i in range(1500)] + [e]\n");
  try {
    read_pickle_file(again, &sink);
    FAIL() << "a reference to a dropped item was followed";
  } catch (const PickleError& e) {
    EXPECT_NE(std::string(e.what()).find("already handed over"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(read_pickle_file(again));
}

}  // namespace
}  // namespace headroom
