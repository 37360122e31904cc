// Small file helpers shared by the daemons (no libtorch, no gRPC).
// Thread safety: free functions; concurrent writers of the same path race on the rename (the
// last one wins), which is fine for the port files they write.
#pragma once

#include <string>

namespace odyssey {

// Writes `text` to `path` atomically: into `<path>.tmp.<pid>`, then renamed onto `path`, so a
// reader (a script waiting for a port file) sees no file or the whole of it. False on failure.
bool WriteFileAtomically(const std::string& path, const std::string& text);

}  // namespace odyssey
