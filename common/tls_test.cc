#include "common/tls.h"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "odyssey/v1/odyssey.grpc.pb.h"

namespace odyssey {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("odyssey_tls_test_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }
  std::filesystem::path dir_;
};

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// A self-signed certificate for "localhost" (its own CA) valid from now + `from` to now + `to`
// seconds, and its key: PEM texts.
struct CertAndKey {
  std::string cert, key;
};
CertAndKey SelfSigned(long from, long to) {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* x = X509_new();
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
  X509_gmtime_adj(X509_getm_notBefore(x), from);
  X509_gmtime_adj(X509_getm_notAfter(x), to);
  X509_set_pubkey(x, key);
  X509_NAME* name = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("localhost"), -1, -1, 0);
  X509_set_issuer_name(x, name);
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, x, x, nullptr, nullptr, 0);
  for (const char* ext : {"subjectAltName=DNS:localhost", "basicConstraints=critical,CA:TRUE"}) {
    const std::string text(ext);
    const size_t eq = text.find('=');
    X509_EXTENSION* e = X509V3_EXT_nconf(nullptr, &ctx, text.substr(0, eq).c_str(), text.substr(eq + 1).c_str());
    X509_add_ext(x, e, -1);
    X509_EXTENSION_free(e);
  }
  X509_sign(x, key, EVP_sha256());
  auto pem = [](auto write) {
    BIO* bio = BIO_new(BIO_s_mem());
    write(bio);
    char* data = nullptr;
    const long n = BIO_get_mem_data(bio, &data);
    std::string out(data, static_cast<size_t>(n));
    BIO_free(bio);
    return out;
  };
  CertAndKey out{pem([&](BIO* b) { PEM_write_bio_X509(b, x); }),
                 pem([&](BIO* b) { PEM_write_bio_PrivateKey(b, key, nullptr, nullptr, 0, nullptr, nullptr); })};
  X509_free(x);
  EVP_PKEY_free(key);
  return out;
}

// Whether a channel with `creds` to a server with `server_creds` completes its transport
// handshake (plaintext HTTP/2, or TLS) within `seconds`.
bool Connects(const std::shared_ptr<grpc::ServerCredentials>& server_creds,
              const std::shared_ptr<grpc::ChannelCredentials>& creds, const grpc::ChannelArguments& args,
              int seconds = 20) {
  int port = 0;
  odyssey::v1::PlannerService::Service unimplemented;  // a server needs a service; no call is made
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", server_creds, &port);
  builder.RegisterService(&unimplemented);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  EXPECT_NE(port, 0);
  auto channel = grpc::CreateCustomChannel("localhost:" + std::to_string(port), creds, args);
  const bool connected = channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  server->Shutdown();
  return connected;
}

// No TLS flags: plaintext on both sides, so a plaintext client talks to the server, and a
// plaintext client cannot talk to a TLS server (the credentials are not TLS in disguise).
TEST_F(TlsTest, NoFlagsIsPlaintext) {
  auto server = MakeServerCredentials({});
  ASSERT_TRUE(server.ok()) << server.status();
  grpc::ChannelArguments args;
  auto client = MakeChannelCredentials({}, &args);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE(Connects(*server, *client, args));

  const CertAndKey good = SelfSigned(-60, 3600);
  const std::string cert = Write("cert.pem", good.cert), key = Write("key.pem", good.key);
  auto tls_server = MakeServerCredentials({cert, key, ""});
  ASSERT_TRUE(tls_server.ok()) << tls_server.status();
  EXPECT_FALSE(Connects(*tls_server, *client, args, 2)) << "a plaintext client reached a TLS server";
  grpc::ChannelArguments tls_args;
  auto tls_client = MakeChannelCredentials({cert, "localhost", "", ""}, &tls_args);
  ASSERT_TRUE(tls_client.ok()) << tls_client.status();
  EXPECT_TRUE(Connects(*tls_server, *tls_client, tls_args));
  EXPECT_FALSE(Connects(*server, *tls_client, tls_args, 2)) << "a TLS client reached a plaintext server";
}

// A certificate outside its validity period is refused at start, naming the flag and the
// path, not at the first handshake.
TEST_F(TlsTest, ExpiredOrNotYetValidCertificateIsRefusedAtStart) {
  struct Case {
    long from, to;
    std::string want;
  };
  const std::vector<Case> cases = {
      {-7200, -3600, "the certificate has expired"},
      {3600, 7200, "the certificate is not valid yet"},
  };
  for (const Case& c : cases) {
    const CertAndKey pair = SelfSigned(c.from, c.to);
    const std::string cert = Write("cert.pem", pair.cert), key = Write("key.pem", pair.key);
    auto creds = MakeServerCredentials({cert, key, ""});
    ASSERT_FALSE(creds.ok()) << c.want;
    EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(creds.status()), HasSubstr("--tls-cert " + cert + ": " + c.want));
  }
  const CertAndKey valid = SelfSigned(-60, 3600);
  EXPECT_TRUE(MakeServerCredentials({Write("cert.pem", valid.cert), Write("key.pem", valid.key), ""}).ok());
}

TEST_F(TlsTest, ServerFlagErrorsNameTheFlag) {
  const std::string junk = Write("junk.pem", "not a certificate\n");
  struct Case {
    ServerTlsFiles files;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{"", "", junk}, "--tls-client-ca: needs --tls-cert and --tls-key"},
      {{junk, "", ""}, "--tls-key: is required with --tls-cert"},
      {{"", junk, ""}, "--tls-cert: is required with --tls-key"},
      {{"/nonexistent/c.pem", junk, ""}, "--tls-cert /nonexistent/c.pem: cannot open the file"},
      {{junk, "/nonexistent/k.pem", ""}, "--tls-key /nonexistent/k.pem: cannot open the file"},
      {{junk, junk, ""}, "--tls-cert " + junk + ": no PEM certificate in the file"},
  };
  for (const Case& c : cases) {
    auto creds = MakeServerCredentials(c.files);
    ASSERT_FALSE(creds.ok()) << c.want;
    EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(creds.status()), HasSubstr(c.want));
  }
}

TEST_F(TlsTest, ClientFlagErrorsNameTheFlag) {
  const std::string junk = Write("junk.pem", "-----BEGIN CERTIFICATE-----\nbroken\n-----END CERTIFICATE-----\n");
  struct Case {
    ClientTlsOptions options;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{"", "localhost", "", ""}, "--tls-server-name: needs --tls-ca"},
      {{"", "", junk, ""}, "--tls-cert: needs --tls-ca"},
      {{"/nonexistent/ca.pem", "", "", ""}, "--tls-ca /nonexistent/ca.pem: cannot open the file"},
      {{junk, "", "", ""}, "--tls-ca " + junk + ": no PEM certificate in the file"},
  };
  for (const Case& c : cases) {
    grpc::ChannelArguments args;
    auto creds = MakeChannelCredentials(c.options, &args);
    ASSERT_FALSE(creds.ok()) << c.want;
    EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(creds.status()), HasSubstr(c.want));
  }
}

TEST_F(TlsTest, ReadTokenFile) {
  const std::string secret = "0123456789abcdef0123456789abcdef";
  EXPECT_EQ(*ReadTokenFile(Write("t1", secret), "--token-file"), secret);
  EXPECT_EQ(*ReadTokenFile(Write("t2", "# my token\n\n  " + secret + "  \r\n"), "--token-file"), secret);

  auto missing = ReadTokenFile("/nonexistent/token", "--token-file");
  EXPECT_THAT(Message(missing.status()), HasSubstr("--token-file /nonexistent/token: cannot open the file"));
  auto empty = ReadTokenFile(Write("t3", "# nothing\n\n"), "--token-file");
  EXPECT_THAT(Message(empty.status()), HasSubstr("no token in the file"));
  // A token file mistaken for the controller's token table: refused, and the token not echoed.
  auto table = ReadTokenFile(Write("t4", secret + " alice\n"), "--token-file");
  EXPECT_FALSE(table.ok());
  EXPECT_THAT(Message(table.status()), Not(HasSubstr(secret)));
  EXPECT_THAT(Message(table.status()), HasSubstr("the file holds the token alone"));
}

}  // namespace
}  // namespace odyssey
