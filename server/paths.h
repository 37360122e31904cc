// Confinement of client-chosen filesystem paths (see server/README.md, "Paths").
//
// Clients name folders and files the workers read and write: JobSpec checkpoint.directory
// (written), data.path and model.name (read), and the TrainingService directories
// (SaveCheckpoint and ExportWeights write, LoadCheckpoint reads). With several tenants, those
// paths must not reach another tenant's data or anything else the workers can touch. A
// PathPolicy says which paths a tenant may name:
//
// - Off (no --path-root): any absolute path, as before confinement existed. For single-tenant
//   or trusted deployments only.
// - On: a tenant may read and write under its tenant folder, <root>/<tenant> (the anonymous
//   tenant of a controller without auth: the whole <root>), and may read, never write, under
//   every shared read root (--shared-read-root: base models and datasets of all tenants).
//   Writes must name something strictly inside the tenant folder (never the folder itself: the
//   workers replace the folder they write).
//
// How a path is judged (Check, when on): it must be absolute, of bounded length and free of NUL
// bytes (else INVALID_ARGUMENT); then both its lexical normal form (`.` and `..` folded without touching
// the filesystem) and its resolved form (std::filesystem::weakly_canonical: symbolic links of
// the part that exists followed, as the kernel will) must lie under one allowed root. So
// `<root>/alice/../bob/x` and a symbolic link inside alice's folder that points at bob's are
// both refused, PERMISSION_DENIED naming the field and the rule. The resolved form is the
// controller's view: the controller must mount the roots at the same paths as the workers.
//
// Limits (documented in server/README.md): the check runs at the controller when the request
// arrives; a tenant able to create symbolic links in its folder by other means (a shared
// volume it mounts itself) could swap one in between the check and the worker's use. Tenants
// get no such access through odyssey's API (it writes only regular files and folders).
//
// Thread safety: immutable after Create; Check may be called from any thread.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace odyssey::server {

// Longest path Check accepts with confinement on, in bytes (Linux's PATH_MAX).
inline constexpr size_t kMaxCheckedPathBytes = 4096;

struct PathPolicyOptions {
  // The folder every client-supplied path must lie under (tenant folders are its children).
  // Empty = confinement off (any absolute path; single-tenant / trusted deployments).
  std::string root;
  // Folders every tenant may read and none may write (base models, datasets). Each must not
  // contain `root` (that would make every tenant's folder readable by all). Requires `root`.
  std::vector<std::string> shared_read_roots;
};

class PathPolicy {
 public:
  enum class Access { kRead, kWrite };

  // Confinement off.
  PathPolicy() = default;
  // Checks and resolves the roots: each must be an absolute path of an existing directory;
  // shared read roots need `root` and must not contain it. Errors are INVALID_ARGUMENT naming
  // the flag (--path-root, --shared-read-root) and the rule.
  static absl::StatusOr<PathPolicy> Create(PathPolicyOptions options);

  bool enabled() const { return !root_.lexical.empty(); }
  // <root>/<tenant>, or <root> for the anonymous tenant (""). REQUIRES: enabled().
  std::string TenantFolder(absl::string_view tenant) const;

  // OK when `tenant` may `access` `path` (see the header comment). `field` names the request
  // field in messages ("spec.checkpoint.directory"). Off: always OK (today's behaviour: the
  // TrainingService's own validation still asks for absolute paths, JobSpec paths may even be
  // relative). On: a path that is empty, relative, longer than kMaxCheckedPathBytes or holds a
  // NUL byte is INVALID_ARGUMENT. REQUIRES: empty paths (a default) are the caller's business.
  absl::Status Check(absl::string_view path, Access access, absl::string_view tenant, absl::string_view field) const;

 private:
  // A root as given (lexically normalized) and as resolved (canonical, symbolic links followed).
  struct Root {
    std::filesystem::path lexical;
    std::filesystem::path resolved;
  };
  // The rule a refused path broke, for messages: "must be under <tenant folder> (the caller's
  // tenant folder) or <shared> (shared, read-only)".
  std::string Rule(absl::string_view tenant, Access access) const;

  Root root_;
  std::vector<Root> shared_;
};

// True when `path` is `root` or lies under it, comparing whole components ("/a/bc" is not
// under "/a/b"). Both must be lexically normal. `strictly`: `root` itself does not count.
bool IsUnder(const std::filesystem::path& path, const std::filesystem::path& root, bool strictly = false);

}  // namespace odyssey::server
