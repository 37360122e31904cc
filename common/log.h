// Structured logging, one line per event: "<time> <level> <message>".
//
// A thin front over spdlog kept free of spdlog/fmt in the header, because libtorch bundles its
// own fmt, which clashes with the system fmt that spdlog is built against: translation units
// that include libtorch log through this header and format with absl::StrCat/StrFormat.
// Thread safety: all functions may be called from any thread.
#pragma once

#include <string_view>

namespace odyssey {

void LogInfo(std::string_view message);
void LogWarning(std::string_view message);
void LogError(std::string_view message);

}  // namespace odyssey
