#include "common/wire_text.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace odyssey {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// True when `s` is valid UTF-8 (checked independently of ValidUtf8: a decoder that accepts
// only the sequences of RFC 3629).
bool IsUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
    unsigned cp;
    size_t n;
    if (b(i) < 0x80) {
      cp = b(i), n = 1;
    } else if ((b(i) & 0xE0) == 0xC0) {
      cp = b(i) & 0x1F, n = 2;
    } else if ((b(i) & 0xF0) == 0xE0) {
      cp = b(i) & 0x0F, n = 3;
    } else if ((b(i) & 0xF8) == 0xF0) {
      cp = b(i) & 0x07, n = 4;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((b(i + k) & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b(i + k) & 0x3F);
    }
    const unsigned min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

TEST(WireTextTest, ValidTextIsUnchanged) {
  const std::string text = "data.path: line 1: invalid JSON (\xC3\xA9t\xC3\xA9, \xE2\x82\xAC, \xF0\x9F\x98\x80)";
  EXPECT_EQ(ValidUtf8(text), text);
  EXPECT_EQ(WireText(text), text);
}

TEST(WireTextTest, InvalidBytesBecomeVisibleEscapes) {
  // The byte a gzip file starts with, quoted by a JSON parse error.
  EXPECT_EQ(ValidUtf8("invalid JSON at \x8b here"), "invalid JSON at \\x8b here");
  // Overlong "/", a surrogate, a code point above U+10FFFF, a truncated sequence at the end.
  for (const std::string& bad : {std::string("\xC0\xAF"), std::string("\xED\xA0\x80"),
                                std::string("\xF4\x90\x80\x80"), std::string("ok\xE2\x82")}) {
    const std::string out = ValidUtf8(bad);
    EXPECT_TRUE(IsUtf8(out)) << out;
    EXPECT_THAT(out, HasSubstr("\\x")) << out;
  }
  EXPECT_EQ(ValidUtf8("\xC0\xAF"), "\\xc0\\xaf");
}

TEST(WireTextTest, EveryByteStringComesOutValid) {
  // All two-byte strings plus a sweep of three-byte prefixes: the output is always UTF-8.
  for (int a = 0; a < 256; ++a) {
    for (int b = 0; b < 256; ++b) {
      const std::string s{static_cast<char>(a), static_cast<char>(b), '\x80', '\xBF'};
      ASSERT_TRUE(IsUtf8(ValidUtf8(s))) << a << " " << b;
    }
  }
}

TEST(WireTextTest, LongTextIsCutOnACharacterBoundaryWithinTheLimit) {
  std::string text = "name: \"";
  for (int i = 0; i < 5000; ++i) text += "\xC3\xA9";  // 2-byte characters
  text += "\" is not a job name";
  const std::string out = WireText(text, 1024);
  EXPECT_LE(out.size(), 1024u);
  EXPECT_TRUE(IsUtf8(out));
  EXPECT_THAT(out, HasSubstr(" more bytes]"));
  EXPECT_EQ(out.rfind("name: \"", 0), 0u);
  // Exactly at the limit: not cut.
  const std::string exact(1024, 'a');
  EXPECT_EQ(WireText(exact, 1024), exact);
  EXPECT_LE(WireText(exact + "b", 1024).size(), 1024u);
}

TEST(WireTextTest, LibraryStackTracesAreDropped) {
  const std::string what =
      "The size of tensor a (4) must match the size of tensor b (5) at non-singleton dimension 1\n"
      "Exception raised from infer_size_impl at ../aten/src/ATen/ExpandUtils.cpp:31 (most recent call first):\n"
      "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)\n"
      "frame #1: <unknown function> + 0x1e (0x7f in libtorch_cpu.so)\n"
      "frame #12: odyssey::engine::Trainer::Step() + 0x42 (0x55 in odyssey-worker)\n";
  const std::string out = WireText("engine error: " + what);
  EXPECT_EQ(out,
            "engine error: The size of tensor a (4) must match the size of tensor b (5) at non-singleton "
            "dimension 1");
  // Text after a trace is kept; "frame #" that is not a frame line is kept.
  EXPECT_EQ(WireText("a\nframe #3: x\nb\nframe #x is text"), "a\nb\nframe #x is text");
  EXPECT_THAT(WireText("see frame #2: fine inline"), Not(HasSubstr("\n")));
  EXPECT_EQ(WireText("see frame #2: fine inline"), "see frame #2: fine inline");
}

}  // namespace
}  // namespace odyssey
