// Bearer-token authentication of odyssey-controller's callers (see server/README.md, "Auth").
//
// A token file (`--auth-token-file`) maps tokens to tenants, one `<token> <tenant>` per line.
// Every call to JobService (and TrainingService) carries metadata `authorization: Bearer
// <token>`; the tenant it maps to owns the jobs the call creates and is the only tenant that
// may see or touch them (Controller enforces that; this unit only says who is calling).
// Workers authenticate with tokens of the reserved tenant `@worker` (kWorkerTenant): those may
// only call WorkerService.Attach, and tenant tokens may not attach. Health checks and
// reflection never ask for a token (Kubernetes probes, grpcurl list).
//
// Auth off (no token file installed) keeps the behaviour of a controller without auth: every
// caller is the one anonymous tenant "" (kAnonymousTenant) and any caller may attach.
//
// Why a per-handler call (CallerTenant) rather than a grpc::AuthMetadataProcessor: gRPC runs
// metadata processors only on secure (TLS) server credentials, and tokens must also work on a
// plaintext port (behind a mesh that terminates TLS, in tests); every handler needs the
// caller's tenant anyway to scope its work, so the check costs nothing extra there; and
// services that must stay open (health, reflection) simply do not call it.
//
// The TokenTable and the process-wide table (SetAuthTokens, TenantOf) know nothing of gRPC;
// CallerTenant/AuthorizeWorker (auth_edge.cc, in the service library) only read the
// `authorization` metadata off a grpc::ServerContext and call TenantOf.
//
// Secrets: no error message or log line contains a token.
//
// Thread safety: TokenTable is immutable after Parse/Load. SetAuthTokens, AuthEnabled,
// TenantOf, CallerTenant and AuthorizeWorker may be called from any thread; SetAuthTokens
// replaces the table atomically (calls in flight finish with the table they started with).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc {
class ServerContext;
}  // namespace grpc

namespace odyssey::server {

// The tenant of every caller when auth is off (and of jobs created with auth off).
inline constexpr char kAnonymousTenant[] = "";
// Tokens of this tenant authenticate workers: they may call WorkerService.Attach and nothing else.
inline constexpr char kWorkerTenant[] = "@worker";
// Token rules: kMinTokenLength..kMaxTokenLength characters of [A-Za-z0-9._~+/=-] (the
// RFC 6750 bearer token alphabet; `openssl rand -hex 32` and `openssl rand -base64 32` fit).
inline constexpr size_t kMinTokenLength = 32;
inline constexpr size_t kMaxTokenLength = 1024;
// Tenant names: 1..kMaxTenantLength characters of [A-Za-z0-9._-] starting with a letter or a
// digit, or exactly kWorkerTenant.
inline constexpr size_t kMaxTenantLength = 63;

// The token -> tenant table of one token file.
class TokenTable {
 public:
  // Parses token file text. File format: one `<token> <tenant>` per line (fields separated by
  // spaces or tabs); lines whose first non-blank character is `#` are comments; blank lines
  // are skipped; a trailing `\r` is ignored. Tokens must follow the token rules above and be
  // unique; a tenant may have several tokens (rotation). At least one token is required.
  // Errors are INVALID_ARGUMENT "<source>:<line>: <what> (<rule>)" and never contain a token.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text, absl::string_view source);
  // Reads and parses the file at `path` (errors name the path).
  static absl::StatusOr<TokenTable> Load(const std::string& path);

  // The tenant of a token. REQUIRES: nothing; an unknown token is UNAUTHENTICATED
  // "bearer token not recognized". Compares against every token in constant time per byte, so
  // the time taken does not say how much of a token matched.
  absl::StatusOr<std::string> TenantOfToken(absl::string_view token) const;
  // The tenant of an `authorization` metadata value: "Bearer <token>" (scheme
  // case-insensitive). Empty (absent) -> UNAUTHENTICATED "missing bearer token: send metadata
  // 'authorization: Bearer <token>'"; another scheme -> UNAUTHENTICATED naming the rule;
  // unknown token -> UNAUTHENTICATED "bearer token not recognized".
  absl::StatusOr<std::string> Authenticate(absl::string_view authorization) const;

  size_t size() const { return entries_.size(); }
  // Distinct tenants with at least one token (kWorkerTenant included).
  size_t tenants() const;

 private:
  std::vector<std::pair<std::string, std::string>> entries_;  // (token, tenant), file order
};

// Installs the table every later TenantOf/CallerTenant call uses; null turns auth off.
void SetAuthTokens(std::shared_ptr<const TokenTable> table);
// True while a table is installed.
bool AuthEnabled();
// The tenant of an `authorization` metadata value (empty = absent) under the installed table:
// kAnonymousTenant when auth is off, else TokenTable::Authenticate's answer.
absl::StatusOr<std::string> TenantOf(absl::string_view authorization);

// --- gRPC edge (server/auth_edge.cc, linked into the service library) ---

// The tenant of the caller of a JobService/TrainingService call: kAnonymousTenant when auth is
// off; UNAUTHENTICATED without a valid bearer token; PERMISSION_DENIED for a worker token
// (worker tokens may only attach). Every handler of a tenant-facing service calls this first
// and passes the tenant to the Controller.
absl::StatusOr<std::string> CallerTenant(const grpc::ServerContext& context);
// OK when the caller may call WorkerService.Attach: auth off, or a kWorkerTenant token.
// UNAUTHENTICATED without a valid token; PERMISSION_DENIED for a tenant token.
absl::Status AuthorizeWorker(const grpc::ServerContext& context);
// For long-lived streams (WatchJob, Attach), asked again while they run: OK when auth is off
// or while the stream's
// token still maps to `tenant` under the installed table (a SIGHUP may have replaced it);
// UNAUTHENTICATED once the token is no longer recognized, PERMISSION_DENIED when it now maps
// to another tenant. Messages say the token changed while the stream was open. PushRollouts
// needs no such call: each of its batches is authenticated as a call of its own.
absl::Status StillAuthorized(const grpc::ServerContext& context, const std::string& tenant);

}  // namespace odyssey::server
