#include "common/tls.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"

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

TEST_F(TlsTest, NoFlagsIsPlaintext) {
  auto server = MakeServerCredentials({});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_NE(*server, nullptr);
  grpc::ChannelArguments args;
  auto client = MakeChannelCredentials({}, &args);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_NE(*client, nullptr);
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
