// Text that leaves a process (a gRPC status message, a job's error, a worker's reply) passes
// WireText: valid UTF-8, bounded in length, and free of library stack traces. The full text
// stays in the caller's log; clients get the part a person reads.
//
// Why one place: protobuf refuses a string field that is not UTF-8 when the receiver parses it
// (a worker whose job error quoted a dataset's 0x8b byte dropped its stream on every attempt to
// report it), gRPC refuses a status message larger than its metadata limit (a 10,000-byte name
// echoed in an error came back as RESOURCE_EXHAUSTED), and libtorch's c10::Error::what()
// appends ~4 KB of "frame #N" lines that say nothing to a caller.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace odyssey {

// The longest text WireText returns, in bytes (well under gRPC's 8 KB default metadata limit,
// so a status message never turns into a transport error).
inline constexpr size_t kMaxWireTextBytes = 1024;

// `text` made valid UTF-8: each byte that does not start or continue a valid sequence (overlong
// forms, surrogates and code points above U+10FFFF included) becomes the four ASCII characters
// "\xNN", so the reader still sees which byte it was. Valid text is returned unchanged.
std::string ValidUtf8(absl::string_view text);

// ValidUtf8(text) without a library stack trace (from a line starting "Exception raised from "
// or "frame #<n>:" to the end of that trace), then cut at `max_bytes` on a character boundary
// with " ... [N more bytes]" appended (the result, suffix included, is at most max_bytes).
// REQUIRES: max_bytes >= 64.
std::string WireText(absl::string_view text, size_t max_bytes = kMaxWireTextBytes);

}  // namespace odyssey
