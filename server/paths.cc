#include "server/paths.h"

#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace odyssey::server {
namespace {

namespace fs = std::filesystem;

// The lexical normal form without a trailing separator ("/a/b/" -> "/a/b"; "/" stays "/").
fs::path Normal(const fs::path& p) {
  fs::path n = p.lexically_normal();
  if (!n.has_filename() && n.has_relative_path()) n = n.parent_path();
  return n;
}

absl::Status FormError(absl::string_view path, absl::string_view field) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": is empty"));
  if (path.size() > kMaxCheckedPathBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": length (", path.size(), ") must be <= ", kMaxCheckedPathBytes, " bytes"));
  }
  if (path.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": must not contain NUL bytes"));
  }
  if (path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": \"", path, "\" must be an absolute path (a relative one depends on the worker's working folder)"));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsUnder(const fs::path& path, const fs::path& root, bool strictly) {
  auto p = path.begin();
  for (auto r = root.begin(); r != root.end(); ++r, ++p) {
    if (r->empty()) continue;  // a trailing separator of `root`
    if (p == path.end() || *p != *r) return false;
  }
  for (; p != path.end(); ++p) {
    if (!p->empty()) return true;  // a component beyond the root
  }
  return !strictly;
}

absl::StatusOr<PathPolicy> PathPolicy::Create(PathPolicyOptions options) {
  PathPolicy policy;
  auto resolve = [](const std::string& dir, absl::string_view flag) -> absl::StatusOr<Root> {
    if (dir.empty() || dir[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": \"", dir, "\" must be an absolute path"));
    }
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": \"", dir, "\" must be an existing directory"));
    }
    Root root;
    root.lexical = Normal(dir);
    root.resolved = Normal(fs::canonical(dir, ec));
    if (ec) return absl::InvalidArgumentError(absl::StrCat(flag, ": \"", dir, "\" cannot be resolved: ", ec.message()));
    return root;
  };
  if (options.root.empty()) {
    if (!options.shared_read_roots.empty()) {
      return absl::InvalidArgumentError(
          "--shared-read-root: requires --path-root (without it every absolute path is allowed anyway)");
    }
    return policy;
  }
  auto root = resolve(options.root, "--path-root");
  if (!root.ok()) return root.status();
  policy.root_ = *std::move(root);
  for (const std::string& dir : options.shared_read_roots) {
    auto shared = resolve(dir, "--shared-read-root");
    if (!shared.ok()) return shared.status();
    if (IsUnder(policy.root_.resolved, shared->resolved) || IsUnder(policy.root_.lexical, shared->lexical)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shared-read-root: \"", dir, "\" must not contain --path-root \"", options.root,
          "\" (every tenant could read every other tenant's folder)"));
    }
    policy.shared_.push_back(*std::move(shared));
  }
  return policy;
}

std::string PathPolicy::TenantFolder(absl::string_view tenant) const {
  return tenant.empty() ? root_.lexical.string() : (root_.lexical / std::string(tenant)).string();
}

std::string PathPolicy::Rule(absl::string_view tenant, Access access) const {
  std::string rule = absl::StrCat("must be ", access == Access::kWrite ? "inside " : "under ", TenantFolder(tenant),
                                  tenant.empty() ? " (the path root)" : " (the caller's tenant folder)");
  if (access == Access::kRead) {
    for (const Root& s : shared_) absl::StrAppend(&rule, " or ", s.lexical.string(), " (shared, read-only)");
  }
  return rule;
}

absl::Status PathPolicy::Check(absl::string_view path, Access access, absl::string_view tenant,
                               absl::string_view field) const {
  if (!enabled()) return absl::OkStatus();
  if (absl::Status form = FormError(path, field); !form.ok()) return form;

  const bool write = access == Access::kWrite;
  const fs::path tenant_lexical = tenant.empty() ? root_.lexical : root_.lexical / std::string(tenant);
  const fs::path tenant_resolved = tenant.empty() ? root_.resolved : root_.resolved / std::string(tenant);
  auto denied = [&](absl::string_view why) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": \"", path, "\" ", Rule(tenant, access), why.empty() ? "" : "; ", why));
  };

  // Shared roots are never written, even where one lies inside a tenant folder.
  const fs::path lexical = Normal(fs::path(std::string(path)));
  if (write) {
    for (const Root& s : shared_) {
      if (IsUnder(lexical, s.lexical)) {
        return denied(absl::StrCat(s.lexical.string(), " is a shared read-only root"));
      }
      // The workers replace the folder they write (and prune checkpoints in it): one holding a
      // shared root would take the shared root with it.
      if (IsUnder(s.lexical, lexical)) {
        return denied(absl::StrCat("it contains the shared read-only root ", s.lexical.string()));
      }
    }
  }
  auto allowed = [&](const fs::path& p, bool resolved) {
    if (IsUnder(p, resolved ? tenant_resolved : tenant_lexical, /*strictly=*/write)) return true;
    if (write) return false;
    for (const Root& s : shared_) {
      if (IsUnder(p, resolved ? s.resolved : s.lexical)) return true;
    }
    return false;
  };
  if (!allowed(lexical, /*resolved=*/false)) {
    return denied(lexical.string() == std::string(path) ? "" : absl::StrCat("it normalizes to ", lexical.string()));
  }

  // Resolve the path as given, not its lexical form: `..` after a symbolic link climbs from the
  // link's target (as the kernel does), which folding `..` first would hide.
  std::error_code ec;
  const fs::path resolved = Normal(fs::weakly_canonical(fs::path(std::string(path)), ec));
  if (ec) return denied(absl::StrCat("it cannot be resolved (", ec.message(), ")"));
  if (write) {
    for (const Root& s : shared_) {
      if (IsUnder(resolved, s.resolved) || IsUnder(s.resolved, resolved)) {
        return denied(absl::StrCat("it resolves (through a symbolic link) into or above ", s.lexical.string(),
                                   ", a shared read-only root"));
      }
    }
  }
  // The target of a link is not named: it may be somebody else's folder.
  if (!allowed(resolved, /*resolved=*/true)) return denied("it resolves (through a symbolic link) outside");
  return absl::OkStatus();
}

}  // namespace odyssey::server
