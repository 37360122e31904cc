// TLS and bearer-token plumbing shared by odyssey's gRPC processes: the controller's server
// credentials (--tls-cert/--tls-key, optional --tls-client-ca), the worker's and the CLI's
// channel credentials (--tls-ca, --tls-server-name, optional --tls-cert/--tls-key for mTLS)
// and their token files.
//
// Every file is read and checked up front, so a bad flag is a clear startup error rather than
// a failed handshake later: messages name the flag and the path ("--tls-key /p: does not match
// the certificate in --tls-cert /q"). The flag names are the same in every binary. PEM
// contents are never echoed; token contents are never echoed.
//
// Thread safety: free functions without shared state.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace grpc {
class ServerCredentials;
class ChannelCredentials;
class ChannelArguments;
class ClientContext;
}  // namespace grpc

namespace odyssey {

struct ServerTlsFiles {
  std::string cert;       // --tls-cert: PEM certificate chain (leaf first); empty = plaintext
  std::string key;        // --tls-key: PEM private key of the leaf (unencrypted)
  std::string client_ca;  // --tls-client-ca: PEM CA bundle; non-empty = clients must present a
                          // certificate it signed (mTLS); empty = no client certificates
};

// Plaintext credentials when files.cert and files.key are both empty; else TLS credentials
// after checking: both given, readable, PEM, the key matches the certificate, the certificate
// is within its validity period, and the client CA (when given) holds a certificate.
// INVALID_ARGUMENT naming the flag otherwise.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const ServerTlsFiles& files);

struct ClientTlsOptions {
  std::string ca;           // --tls-ca: PEM CA bundle that signed the server; empty = plaintext
  std::string server_name;  // --tls-server-name: the name to verify in the server's
                            // certificate instead of the address's host (tests, IP addresses)
  std::string cert;         // --tls-cert: client certificate for mTLS; empty = none
  std::string key;          // --tls-key: its private key
};

// Plaintext credentials when options.ca is empty (then server_name/cert/key must be empty
// too); else TLS credentials trusting only options.ca. Sets the target-name override on `args`
// when server_name is given. INVALID_ARGUMENT naming the flag on unreadable or non-PEM files, a
// key that does not match its certificate, or flags that need --tls-ca without it.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const ClientTlsOptions& options,
                                                                                 grpc::ChannelArguments* args);

// Reads a bearer token from a file: the first line that is neither blank nor a `#` comment,
// without surrounding whitespace. `flag` names where the path came from in errors
// ("--token-file"). The token must be one word; its value is never put in an error.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& flag);

// Adds `authorization: Bearer <token>` to a call; nothing when token is empty.
void AddBearerToken(const std::string& token, grpc::ClientContext* context);

}  // namespace odyssey
