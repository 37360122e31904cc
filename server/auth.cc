#include "server/auth.h"

#include <fstream>
#include <set>
#include <sstream>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/files.h"

namespace odyssey::server {
namespace {

bool IsTokenChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_' || c == '~' ||
         c == '+' || c == '/' || c == '=';
}

bool IsTenantChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
}

constexpr char kTokenRule[] = "tokens are 32 to 1024 characters of [A-Za-z0-9._~+/=-]";
constexpr char kTenantRule[] =
    "tenant names are 1 to 63 characters of [A-Za-z0-9._-] starting with a letter or digit, or the reserved "
    "\"@worker\"";

// Why `tenant` is not a valid tenant name, or "" when it is.
std::string TenantProblem(absl::string_view tenant) {
  if (tenant == kWorkerTenant) return "";
  if (tenant.size() > kMaxTenantLength) return absl::StrCat("is ", tenant.size(), " characters long");
  if (!absl::ascii_isalnum(static_cast<unsigned char>(tenant[0]))) {
    return "does not start with a letter or digit";
  }
  for (char c : tenant) {
    if (!IsTenantChar(c)) return "contains a character outside [A-Za-z0-9._-]";
  }
  return "";
}

// Equal without an early exit, so the time taken does not depend on where a guess diverges.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// The process-wide table (leaked on purpose: no destructor runs at exit while handler threads
// may still read it).
struct Installed {
  absl::Mutex mu;
  std::shared_ptr<const TokenTable> table ABSL_GUARDED_BY(mu);
};

Installed& InstalledTokens() {
  static Installed* installed = new Installed;
  return *installed;
}

std::shared_ptr<const TokenTable> InstalledTable() {
  Installed& installed = InstalledTokens();
  absl::MutexLock lock(&installed.mu);
  return installed.table;
}

}  // namespace

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text, absl::string_view source) {
  TokenTable table;
  // token -> its line, for the uniqueness rule (the error names the first line, not the token).
  absl::flat_hash_map<std::string, int> line_of;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    auto error = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": ", what));
    };
    if (absl::EndsWith(line, "\r")) line.remove_suffix(1);
    const absl::string_view trimmed = absl::StripAsciiWhitespace(line);
    if (trimmed.empty() || trimmed[0] == '#') continue;
    std::vector<absl::string_view> fields = absl::StrSplit(trimmed, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return error(absl::StrCat("expected 2 fields, found ", fields.size(),
                                " (each line is '<token> <tenant>', separated by spaces; '#' starts a comment line)"));
    }
    const absl::string_view token = fields[0];
    const absl::string_view tenant = fields[1];
    if (token.size() < kMinTokenLength) {
      return error(absl::StrCat("token is too short: ", token.size(), " characters (", kTokenRule, ")"));
    }
    if (token.size() > kMaxTokenLength) {
      return error(absl::StrCat("token is too long: ", token.size(), " characters (", kTokenRule, ")"));
    }
    for (size_t i = 0; i < token.size(); ++i) {
      if (!IsTokenChar(token[i])) {
        return error(absl::StrCat("token has a character outside the token alphabet at position ", i + 1, " (",
                                  kTokenRule, ")"));
      }
    }
    if (std::string why = TenantProblem(tenant); !why.empty()) {
      return error(absl::StrCat("tenant \"", tenant, "\" ", why, " (", kTenantRule, ")"));
    }
    auto [it, inserted] = line_of.emplace(std::string(token), line_number);
    if (!inserted) {
      return error(absl::StrCat("token repeats the token of line ", it->second, " (tokens must be unique)"));
    }
    table.entries_.emplace_back(std::string(token), std::string(tenant));
  }
  if (table.entries_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": no tokens (the file needs at least one '<token> <tenant>' line; without a token "
                             "file auth is off)"));
  }
  return table;
}

absl::StatusOr<TokenTable> TokenTable::Load(const std::string& path) {
  absl::StatusOr<std::string> text = ReadRegularFile(path, 64 << 20);
  if (!text.ok()) {
    return absl::Status(text.status().code(), absl::StrCat(text.status().message(), " (the token file)"));
  }
  return Parse(*text, path);
}

absl::StatusOr<std::string> TokenTable::TenantOfToken(absl::string_view token) const {
  const std::string* tenant = nullptr;
  for (const auto& [t, name] : entries_) {
    if (ConstantTimeEquals(t, token) && tenant == nullptr) tenant = &name;
  }
  if (tenant == nullptr) return absl::UnauthenticatedError("bearer token not recognized");
  return *tenant;
}

absl::StatusOr<std::string> TokenTable::Authenticate(absl::string_view authorization) const {
  if (absl::StripAsciiWhitespace(authorization).empty()) {
    return absl::UnauthenticatedError("missing bearer token: send metadata 'authorization: Bearer <token>'");
  }
  constexpr absl::string_view kScheme = "bearer ";
  if (authorization.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError(
        "authorization metadata is not a bearer token: send metadata 'authorization: Bearer <token>'");
  }
  return TenantOfToken(absl::StripAsciiWhitespace(authorization.substr(kScheme.size())));
}

size_t TokenTable::tenants() const {
  std::set<absl::string_view> names;
  for (const auto& [token, tenant] : entries_) names.insert(tenant);
  return names.size();
}

void SetAuthTokens(std::shared_ptr<const TokenTable> table) {
  Installed& installed = InstalledTokens();
  absl::MutexLock lock(&installed.mu);
  installed.table.swap(table);
  // The previous table dies here or with the last call in flight that holds it.
}

bool AuthEnabled() { return InstalledTable() != nullptr; }

absl::StatusOr<std::string> TenantOf(absl::string_view authorization) {
  std::shared_ptr<const TokenTable> table = InstalledTable();
  if (!table) return std::string(kAnonymousTenant);
  return table->Authenticate(authorization);
}

}  // namespace odyssey::server
