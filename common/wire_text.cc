#include "common/wire_text.h"

#include <cstdint>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace odyssey {

namespace {

// Length of the valid UTF-8 sequence starting at text[i], or 0 when the byte there does not
// start one (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
size_t ValidSequenceLength(absl::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(text[k]); };
  const uint8_t b0 = byte(i);
  if (b0 < 0x80) return 1;
  size_t n;
  uint8_t lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;  // overlong
    if (b0 == 0xED) hi = 0x9F;  // surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;  // overlong
    if (b0 == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return n;
}

bool StartsTrace(absl::string_view line) {
  line = absl::StripLeadingAsciiWhitespace(line);
  if (absl::StartsWith(line, "Exception raised from ")) return true;
  if (!absl::StartsWith(line, "frame #")) return false;
  line.remove_prefix(7);
  size_t digits = 0;
  while (digits < line.size() && line[digits] >= '0' && line[digits] <= '9') ++digits;
  return digits > 0 && digits < line.size() && line[digits] == ':';
}

}  // namespace

std::string ValidUtf8(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t n = ValidSequenceLength(text, i);
    if (n == 0) {
      absl::StrAppendFormat(&out, "\\x%02x", static_cast<uint8_t>(text[i]));
      ++i;
    } else {
      out.append(text.data() + i, n);
      i += n;
    }
  }
  return out;
}

std::string WireText(absl::string_view text, size_t max_bytes) {
  if (max_bytes < 64) max_bytes = 64;
  // Drop trace lines ("Exception raised from ..." and the "frame #N: ..." lines under it);
  // the lines before and after (libtorch puts the message first) stay.
  std::string kept;
  bool in_trace = false;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (StartsTrace(line)) {
      in_trace = true;
      continue;
    }
    // A trace continues over its frame lines; the first other non-empty line ends it.
    if (in_trace && absl::StripAsciiWhitespace(line).empty()) continue;
    in_trace = false;
    if (!kept.empty()) kept.push_back('\n');
    kept.append(line.data(), line.size());
  }
  while (!kept.empty() && (kept.back() == '\n' || kept.back() == ' ')) kept.pop_back();
  std::string valid = ValidUtf8(kept);
  if (valid.size() <= max_bytes) return valid;
  // Cut on a character boundary, leaving room for the suffix.
  const std::string probe = absl::StrCat(" ... [", valid.size(), " more bytes]");
  size_t cut = max_bytes - probe.size();
  while (cut > 0 && (static_cast<uint8_t>(valid[cut]) & 0xC0) == 0x80) --cut;
  return absl::StrCat(valid.substr(0, cut), " ... [", valid.size() - cut, " more bytes]");
}

}  // namespace odyssey
