#include "server/auth.h"

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace odyssey::server {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// 32 characters: the shortest valid token.
const std::string kAlice = "alice-token-0123456789abcdef0123";
const std::string kBob = "bob+token/0123456789ABCDEFGHIJ==";
const std::string kWorker = "worker_token.0123456789~abcdefgh";

TEST(TokenTableTest, ParsesCommentsBlankLinesTabsAndCrlf) {
  const std::string text = "# odyssey tokens\n\n   \n" + kAlice + " alice\r\n  # indented comment\n" + kBob +
                           "\t\tbob  \n" + kWorker + " @worker\n" + std::string(40, 'z') + " alice";  // no final \n
  auto table = TokenTable::Parse(text, "tokens.txt");
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->size(), 4u);
  EXPECT_EQ(table->tenants(), 3u);  // alice twice (rotation), bob, @worker
  EXPECT_EQ(*table->TenantOfToken(kAlice), "alice");
  EXPECT_EQ(*table->TenantOfToken(std::string(40, 'z')), "alice");
  EXPECT_EQ(*table->TenantOfToken(kBob), "bob");
  EXPECT_EQ(*table->TenantOfToken(kWorker), kWorkerTenant);
}

struct BadFile {
  std::string name;
  std::string text;
  std::string want;  // substring of the message: the line and the rule
};

TEST(TokenTableTest, BadLinesNameFileLineAndRuleButNotTheToken) {
  const std::string short_token = "short-secret-token-1234567890";  // 29 characters
  const std::vector<BadFile> cases = {
      {"one field", "# c\n" + kAlice + "\n", "f.txt:2: expected 2 fields, found 1 (each line is '<token> <tenant>'"},
      {"three fields", kAlice + " alice extra\n", "f.txt:1: expected 2 fields, found 3"},
      {"inline comment", kAlice + " alice # owner\n", "f.txt:1: expected 2 fields, found 4"},
      {"short token", "\n\n" + short_token + " alice\n",
       "f.txt:3: token is too short: 29 characters (tokens are 32 to 1024 characters of [A-Za-z0-9._~+/=-])"},
      {"long token", std::string(1025, 'a') + " alice\n", "f.txt:1: token is too long: 1025 characters"},
      {"bad token char", "alice-token-0123456789abcdef012\"3 alice\n",
       "f.txt:1: token has a character outside the token alphabet at position 32"},
      {"bad tenant char", kAlice + " alice!\n",
       "f.txt:1: tenant \"alice!\" contains a character outside [A-Za-z0-9._-] (tenant names are 1 to 63"},
      {"tenant starts with dash", kAlice + " -alice\n",
       "f.txt:1: tenant \"-alice\" does not start with a letter or digit"},
      {"unknown reserved tenant", kAlice + " @admin\n",
       "f.txt:1: tenant \"@admin\" does not start with a letter or digit (tenant names are 1 to 63 characters of "
       "[A-Za-z0-9._-] starting with a letter or digit, or the reserved \"@worker\")"},
      {"long tenant", kAlice + " " + std::string(64, 't') + "\n", "f.txt:1: tenant \"" + std::string(64, 't') +
                                                                      "\" is 64 characters long"},
      {"duplicate token", kAlice + " alice\n# x\n" + kAlice + " bob\n",
       "f.txt:3: token repeats the token of line 1 (tokens must be unique)"},
      {"empty file", "", "f.txt: no tokens"},
      {"comments only", "# nothing\n\n", "f.txt: no tokens"},
  };
  for (const BadFile& c : cases) {
    auto table = TokenTable::Parse(c.text, "f.txt");
    ASSERT_FALSE(table.ok()) << c.name;
    EXPECT_EQ(table.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(std::string(table.status().message()),
                AllOf(HasSubstr(c.want), Not(HasSubstr(kAlice)), Not(HasSubstr(short_token))))
        << c.name;
  }
}

TEST(TokenTableTest, LoadNamesTheFile) {
  auto missing = TokenTable::Load("/nonexistent/odyssey-tokens");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent/odyssey-tokens: cannot open"));

  const auto path = std::filesystem::temp_directory_path() / ("odyssey_auth_test_" + std::to_string(getpid()));
  {
    std::ofstream out(path);
    out << kAlice << " alice\nbad\n";
  }
  auto bad = TokenTable::Load(path.string());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(path.string() + ":2: expected 2 fields"));
  {
    std::ofstream out(path);
    out << kAlice << " alice\n";
  }
  auto good = TokenTable::Load(path.string());
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(*good->TenantOfToken(kAlice), "alice");
  std::filesystem::remove(path);
}

TEST(TokenTableTest, Authenticate) {
  auto table = TokenTable::Parse(kAlice + " alice\n" + kBob + " bob\n" + kWorker + " @worker\n", "t");
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(*table->Authenticate("Bearer " + kAlice), "alice");
  EXPECT_EQ(*table->Authenticate("bearer " + kBob), "bob");  // the scheme is case-insensitive
  EXPECT_EQ(*table->Authenticate("BEARER  " + kWorker + " "), kWorkerTenant);

  auto missing = table->Authenticate("");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(missing.status().message(), "missing bearer token: send metadata 'authorization: Bearer <token>'");

  for (const std::string& wrong : {"Bearer " + kAlice + "x", "Bearer " + kAlice.substr(1),
                                   "Bearer " + kBob.substr(0, 31) + "X", std::string("Bearer nope")}) {
    auto unknown = table->Authenticate(wrong);
    EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnauthenticated) << wrong;
    EXPECT_EQ(unknown.status().message(), "bearer token not recognized") << wrong;
  }
  for (const std::string& scheme : {"Basic " + kAlice, kAlice, std::string("Bearer"), std::string("Bearer ")}) {
    auto bad = table->Authenticate(scheme);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnauthenticated) << scheme;
    EXPECT_THAT(std::string(bad.status().message()), Not(HasSubstr(kAlice))) << scheme;
  }
  EXPECT_THAT(std::string(table->Authenticate("Basic " + kAlice).status().message()),
              HasSubstr("not a bearer token: send metadata 'authorization: Bearer <token>'"));
}

TEST(AuthTest, InstalledTableTurnsAuthOnAndOff) {
  SetAuthTokens(nullptr);
  EXPECT_FALSE(AuthEnabled());
  EXPECT_EQ(*TenantOf(""), kAnonymousTenant);  // auth off: everyone is the anonymous tenant
  EXPECT_EQ(*TenantOf("Bearer whatever"), kAnonymousTenant);

  auto table = TokenTable::Parse(kAlice + " alice\n", "t");
  ASSERT_TRUE(table.ok());
  SetAuthTokens(std::make_shared<const TokenTable>(*table));
  EXPECT_TRUE(AuthEnabled());
  EXPECT_EQ(*TenantOf("Bearer " + kAlice), "alice");
  EXPECT_EQ(TenantOf("").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(TenantOf("Bearer " + kBob).status().code(), absl::StatusCode::kUnauthenticated);

  // A reload replaces the table: the old token stops working, the new one works.
  auto reloaded = TokenTable::Parse(kBob + " bob\n", "t");
  ASSERT_TRUE(reloaded.ok());
  SetAuthTokens(std::make_shared<const TokenTable>(*reloaded));
  EXPECT_EQ(*TenantOf("Bearer " + kBob), "bob");
  EXPECT_EQ(TenantOf("Bearer " + kAlice).status().code(), absl::StatusCode::kUnauthenticated);
  SetAuthTokens(nullptr);
  EXPECT_FALSE(AuthEnabled());
}

}  // namespace
}  // namespace odyssey::server
