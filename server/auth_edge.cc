// The gRPC edge of server/auth.h: reads the `authorization` metadata of a call.
#include "absl/strings/str_cat.h"
#include "grpcpp/server_context.h"
#include "server/auth.h"
#include "spdlog/spdlog.h"

namespace odyssey::server {
namespace {

// The caller's tenant under the installed table (auth off: anonymous), logging refusals with
// the peer (never the token).
absl::StatusOr<std::string> Authenticated(const grpc::ServerContext& context) {
  if (!AuthEnabled()) return std::string(kAnonymousTenant);
  const auto& metadata = context.client_metadata();
  auto [first, last] = metadata.equal_range("authorization");
  absl::StatusOr<std::string> tenant;
  if (first != last && std::next(first) != last) {
    tenant = absl::UnauthenticatedError(
        "more than one 'authorization' metadata value: send exactly one 'authorization: Bearer <token>'");
  } else {
    const absl::string_view value = first == last ? absl::string_view()
                                                  : absl::string_view(first->second.data(), first->second.size());
    tenant = TenantOf(value);
  }
  if (!tenant.ok()) {
    spdlog::warn("auth: refused a call from {}: {}", context.peer(), std::string(tenant.status().message()));
  }
  return tenant;
}

}  // namespace

absl::StatusOr<std::string> CallerTenant(const grpc::ServerContext& context) {
  absl::StatusOr<std::string> tenant = Authenticated(context);
  if (!tenant.ok()) return tenant.status();
  if (*tenant == kWorkerTenant) {
    spdlog::warn("auth: refused a worker token from {} on a tenant service", context.peer());
    return absl::PermissionDeniedError(
        absl::StrCat("worker tokens (tenant ", kWorkerTenant, ") may only call WorkerService.Attach"));
  }
  return tenant;
}

absl::Status AuthorizeWorker(const grpc::ServerContext& context) {
  absl::StatusOr<std::string> tenant = Authenticated(context);
  if (!tenant.ok()) return tenant.status();
  if (AuthEnabled() && *tenant != kWorkerTenant) {
    spdlog::warn("auth: refused Attach from {} with a token of tenant {}", context.peer(), *tenant);
    return absl::PermissionDeniedError(absl::StrCat("WorkerService.Attach needs a worker token (tenant ",
                                                    kWorkerTenant, " in the controller's --auth-token-file); this "
                                                    "token belongs to tenant \"", *tenant, "\""));
  }
  return absl::OkStatus();
}

absl::Status StillAuthorized(const grpc::ServerContext& context, const std::string& tenant) {
  if (!AuthEnabled()) return absl::OkStatus();  // auth cannot be turned on while running
  absl::StatusOr<std::string> now = Authenticated(context);
  if (!now.ok()) {
    return absl::UnauthenticatedError(
        absl::StrCat("the bearer token of this stream stopped working while it was open (the controller's token "
                     "file changed): ", now.status().message()));
  }
  if (*now != tenant) {
    spdlog::warn("auth: ended a stream from {}: its token moved from tenant {} to {}", context.peer(), tenant, *now);
    return absl::PermissionDeniedError(absl::StrCat("the bearer token of this stream now belongs to tenant \"", *now,
                                                    "\", not \"", tenant, "\" (the controller's token file changed)"));
  }
  return absl::OkStatus();
}

}  // namespace odyssey::server
