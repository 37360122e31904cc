#include "common/log.h"

#include "spdlog/spdlog.h"

namespace odyssey {

void LogInfo(std::string_view message) { spdlog::info("{}", message); }
void LogWarning(std::string_view message) { spdlog::warn("{}", message); }
void LogError(std::string_view message) { spdlog::error("{}", message); }

}  // namespace odyssey
