#include "common/version.h"

#ifndef ODYSSEY_VERSION
#error "ODYSSEY_VERSION is set by common/CMakeLists.txt"
#endif
#ifndef ODYSSEY_REVISION
#define ODYSSEY_REVISION ""
#endif

namespace odyssey {

const char* ProjectVersion() { return ODYSSEY_VERSION; }

const char* SourceRevision() { return ODYSSEY_REVISION; }

std::string VersionLine(const std::string& program) {
  std::string line = program + " " + ProjectVersion();
  const std::string revision = SourceRevision();
  if (!revision.empty()) line += " (" + revision + ")";
  return line;
}

}  // namespace odyssey
