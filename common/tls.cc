#include "common/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace odyssey {
namespace {

// "--flag path: " for error messages.
std::string Where(const std::string& flag, const std::string& path) { return absl::StrCat(flag, " ", path, ": "); }

absl::StatusOr<std::string> ReadFile(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(Where(flag, path), "cannot open the file"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(Where(flag, path), "cannot read the file"));
  return text.str();
}

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using Bio = std::unique_ptr<BIO, BioDeleter>;
using Cert = std::unique_ptr<X509, X509Deleter>;
using Key = std::unique_ptr<EVP_PKEY, KeyDeleter>;

Bio MemoryBio(const std::string& pem) { return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()))); }

// The first certificate of a PEM file (the leaf of a chain).
absl::StatusOr<Cert> FirstCertificate(const std::string& flag, const std::string& path, const std::string& pem) {
  Bio bio = MemoryBio(pem);
  Cert cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (!cert) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(flag, path), "no PEM certificate in the file (want '-----BEGIN CERTIFICATE-----')"));
  }
  return cert;
}

// Reads a certificate + key pair and checks that they belong together and that the
// certificate is valid now.
absl::Status CheckKeyPair(const std::string& cert_flag, const std::string& cert_path, const std::string& cert_pem,
                          const std::string& key_flag, const std::string& key_path, const std::string& key_pem) {
  absl::StatusOr<Cert> cert = FirstCertificate(cert_flag, cert_path, cert_pem);
  if (!cert.ok()) return cert.status();
  Bio bio = MemoryBio(key_pem);
  // An empty passphrase callback result: an encrypted key fails here instead of prompting.
  Key key(PEM_read_bio_PrivateKey(bio.get(), nullptr, [](char*, int, int, void*) { return 0; }, nullptr));
  ERR_clear_error();
  if (!key) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(key_flag, key_path), "no unencrypted PEM private key in the file (want '-----BEGIN PRIVATE KEY-----')"));
  }
  if (X509_check_private_key(cert->get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(Where(key_flag, key_path), "does not match the certificate in ", cert_flag, " ", cert_path));
  }
  if (X509_cmp_current_time(X509_get0_notAfter(cert->get())) <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(Where(cert_flag, cert_path), "the certificate has expired"));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(cert->get())) >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(Where(cert_flag, cert_path), "the certificate is not valid yet"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadCaBundle(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadFile(flag, path);
  if (!pem.ok()) return pem.status();
  if (absl::Status s = FirstCertificate(flag, path, *pem).status(); !s.ok()) return s;
  return pem;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const ServerTlsFiles& files) {
  if (files.cert.empty() && files.key.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca: needs --tls-cert and --tls-key (mTLS is on top of TLS)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (files.cert.empty()) return absl::InvalidArgumentError("--tls-cert: is required with --tls-key");
  if (files.key.empty()) return absl::InvalidArgumentError("--tls-key: is required with --tls-cert");
  absl::StatusOr<std::string> cert = ReadFile("--tls-cert", files.cert);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFile("--tls-key", files.key);
  if (!key.ok()) return key.status();
  if (absl::Status s = CheckKeyPair("--tls-cert", files.cert, *cert, "--tls-key", files.key, *key); !s.ok()) return s;
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (!files.client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadCaBundle("--tls-client-ca", files.client_ca);
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const ClientTlsOptions& options,
                                                                                 grpc::ChannelArguments* args) {
  if (options.ca.empty()) {
    using Flag = std::pair<const char*, const std::string*>;
    for (const auto& [flag, value] :
         {Flag{"--tls-server-name", &options.server_name}, Flag{"--tls-cert", &options.cert},
          Flag{"--tls-key", &options.key}}) {
      if (!value->empty()) {
        return absl::InvalidArgumentError(absl::StrCat(flag, ": needs --tls-ca (TLS is off without it)"));
      }
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  absl::StatusOr<std::string> ca = ReadCaBundle("--tls-ca", options.ca);
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *ca;
  if (options.cert.empty() != options.key.empty()) {
    return absl::InvalidArgumentError(options.cert.empty() ? "--tls-cert: is required with --tls-key"
                                                           : "--tls-key: is required with --tls-cert");
  }
  if (!options.cert.empty()) {
    absl::StatusOr<std::string> cert = ReadFile("--tls-cert", options.cert);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFile("--tls-key", options.key);
    if (!key.ok()) return key.status();
    if (absl::Status s = CheckKeyPair("--tls-cert", options.cert, *cert, "--tls-key", options.key, *key); !s.ok()) {
      return s;
    }
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  if (!options.server_name.empty()) args->SetSslTargetNameOverride(options.server_name);
  return grpc::SslCredentials(ssl);
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& flag) {
  absl::StatusOr<std::string> text = ReadFile(flag, path);
  if (!text.ok()) return text.status();
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    for (char c : line) {
      if (absl::ascii_isspace(static_cast<unsigned char>(c)) || !absl::ascii_isprint(static_cast<unsigned char>(c))) {
        return absl::InvalidArgumentError(absl::StrCat(
            Where(flag, path), "the token line has a space or a control character (the file holds the token alone)"));
      }
    }
    return std::string(line);
  }
  return absl::InvalidArgumentError(absl::StrCat(Where(flag, path), "no token in the file (only blank or # lines)"));
}

void AddBearerToken(const std::string& token, grpc::ClientContext* context) {
  if (!token.empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
}

}  // namespace odyssey
