// The one version string of every odyssey binary (`--version`) and of the `odyssey_build_info`
// series every /metrics endpoint serves.
//
// The project version comes from CMake's `project(odyssey VERSION ...)`; the revision is
// `git describe --always --dirty` of the source tree when CMake configured the build (empty
// when the source is not a git checkout). Only common/version.cc sees the two definitions, so a
// new revision recompiles one file. The revision is the configure step's: commits made since
// then show only after the next cmake run (scripts/build.sh runs one every time).
//
// Thread safety: constant strings.
#pragma once

#include <string>

namespace odyssey {

// "0.1.0".
const char* ProjectVersion();
// "0680f37", "v0.1.0-3-g0680f37-dirty"; "" when unknown.
const char* SourceRevision();
// "<program> 0.1.0 (0680f37)", or "<program> 0.1.0" without a revision: what --version prints.
std::string VersionLine(const std::string& program);

}  // namespace odyssey
