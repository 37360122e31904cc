#include "server/paths.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace odyssey::server {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Access = PathPolicy::Access;

// A path root with tenant folders alice and bob, a shared read root beside it, and symbolic
// links inside alice's folder that point at bob's folder, at the shared root and outside.
class PathPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("odyssey_paths_test_" + std::to_string(getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(base_);
    root_ = (base_ / "root").string();
    shared_ = (base_ / "shared").string();
    outside_ = (base_ / "outside").string();
    for (const std::string& d : {root_ + "/alice/models", root_ + "/bob/ckpt", shared_ + "/llama", outside_}) {
      fs::create_directories(d);
    }
    fs::create_directory_symlink(root_ + "/bob", root_ + "/alice/to-bob");
    fs::create_directory_symlink(root_ + "/bob/ckpt", root_ + "/alice/to-bob-ckpt");
    fs::create_directory_symlink(outside_, root_ + "/alice/to-outside");
    fs::create_directory_symlink(shared_ + "/llama", root_ + "/alice/to-shared");
    fs::create_directory_symlink(root_ + "/alice/models", root_ + "/alice/to-own");
    auto policy = PathPolicy::Create({.root = root_, .shared_read_roots = {shared_}});
    ASSERT_TRUE(policy.ok()) << policy.status();
    policy_ = *std::move(policy);
  }
  void TearDown() override { fs::remove_all(base_); }

  fs::path base_;
  std::string root_, shared_, outside_;
  PathPolicy policy_;
};

TEST_F(PathPolicyTest, Table) {
  struct Case {
    std::string path;
    Access access;
    std::string tenant;
    absl::StatusCode code;
    std::string what;  // for failure messages
  };
  const absl::StatusCode kOk = absl::StatusCode::kOk;
  const absl::StatusCode kDenied = absl::StatusCode::kPermissionDenied;
  const absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  const std::string alice = root_ + "/alice";
  const Case cases[] = {
      {alice + "/models", Access::kRead, "alice", kOk, "existing folder inside the tenant folder"},
      {alice + "/new/export", Access::kWrite, "alice", kOk, "new folder inside the tenant folder"},
      {alice + "/models/", Access::kWrite, "alice", kOk, "trailing slash"},
      {alice + "/./models/../x", Access::kWrite, "alice", kOk, "dots that stay inside"},
      {alice + "/to-own/x", Access::kWrite, "alice", kOk, "symbolic link to the tenant's own folder"},
      {alice, Access::kRead, "alice", kOk, "the tenant folder itself, read"},
      {alice, Access::kWrite, "alice", kDenied, "the tenant folder itself, written (workers replace it)"},
      {alice + "/", Access::kWrite, "alice", kDenied, "the tenant folder with a slash, written"},
      {root_ + "/bob/ckpt", Access::kRead, "alice", kDenied, "another tenant's folder, read"},
      {root_ + "/bob/ckpt", Access::kWrite, "alice", kDenied, "another tenant's folder, written"},
      {root_ + "/alicex/a", Access::kWrite, "alice", kDenied, "a sibling whose name starts like the tenant's"},
      {root_ + "/x", Access::kRead, "alice", kDenied, "the root, outside any tenant folder"},
      {outside_ + "/f", Access::kRead, "alice", kDenied, "outside every root"},
      {"/etc/passwd", Access::kRead, "alice", kDenied, "a system file"},
      {alice + "/../bob/ckpt", Access::kRead, "alice", kDenied, "a .. escape into another tenant"},
      {alice + "/../../outside", Access::kWrite, "alice", kDenied, "a .. escape out of the root"},
      {alice + "/to-bob/ckpt", Access::kRead, "alice", kDenied, "symbolic link to another tenant"},
      {alice + "/to-outside/new", Access::kWrite, "alice", kDenied, "symbolic link out of the root, new child"},
      {alice + "/to-outside", Access::kRead, "alice", kDenied, "symbolic link out of the root itself"},
      {alice + "/to-bob-ckpt/../planted", Access::kWrite, "alice", kDenied,
       "lexically inside, but .. after a link climbs from the link's target (bob's folder)"},
      {alice + "/to-bob/ckpt/../../alice/models", Access::kRead, "alice", kOk,
       "through bob's folder and back: resolves into alice's"},
      {alice + "/new/../../bob/ckpt", Access::kWrite, "alice", kDenied, ".. through a folder that does not exist"},
      {shared_ + "/llama", Access::kRead, "alice", kOk, "shared read root, read"},
      {shared_ + "/llama", Access::kRead, "bob", kOk, "shared read root, read by another tenant"},
      {shared_ + "/llama/out", Access::kWrite, "alice", kDenied, "shared read root, written"},
      {alice + "/to-shared/out", Access::kWrite, "alice", kDenied, "shared read root written through a link"},
      {alice + "/to-shared", Access::kRead, "alice", kOk, "shared read root read through a link"},
      {"models/x", Access::kRead, "alice", kInvalid, "relative path"},
      {"./x", Access::kWrite, "alice", kInvalid, "relative path with a dot"},
      {std::string("/a\0b", 4), Access::kRead, "alice", kInvalid, "NUL byte"},
      {root_ + "/x", Access::kWrite, "", kOk, "anonymous tenant: the whole root"},
      {root_ + "/bob/ckpt", Access::kRead, "", kOk, "anonymous tenant: any folder under the root"},
      {root_, Access::kWrite, "", kDenied, "anonymous tenant: the root itself, written"},
      {outside_, Access::kRead, "", kDenied, "anonymous tenant: outside the root"},
  };
  for (const Case& c : cases) {
    const absl::Status s = policy_.Check(c.path, c.access, c.tenant, "directory");
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << c.path << " -> " << s;
    if (!s.ok()) {
      EXPECT_THAT(std::string(s.message()), ::testing::StartsWith("directory: ")) << c.what;
    }
  }
}

TEST_F(PathPolicyTest, MessagesNameTheFieldAndTheRule) {
  absl::Status s = policy_.Check(root_ + "/bob/ckpt", Access::kRead, "alice", "spec.model.name");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(), "spec.model.name: \"" + root_ + "/bob/ckpt\" must be under " + root_ +
                             "/alice (the caller's tenant folder) or " + shared_ + " (shared, read-only)");
  s = policy_.Check(shared_ + "/llama/x", Access::kWrite, "alice", "directory");
  EXPECT_THAT(s.message(), HasSubstr("must be inside " + root_ + "/alice (the caller's tenant folder)"));
  EXPECT_THAT(s.message(), HasSubstr(shared_ + " is a shared read-only root"));
  s = policy_.Check(root_ + "/alice/../bob", Access::kRead, "alice", "directory");
  EXPECT_THAT(s.message(), HasSubstr("normalizes to " + root_ + "/bob"));
  s = policy_.Check(root_ + "/alice/to-bob/ckpt", Access::kRead, "alice", "directory");
  EXPECT_THAT(s.message(), HasSubstr("resolves (through a symbolic link) outside"));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("/bob/ckpt\"")));  // only the path as given is quoted
}

TEST(PathPolicySharedInsideATenantTest, WritesNeverReachTheSharedRoot) {
  // An operator put a shared root inside alice's folder: alice may read it, write beside it,
  // but neither write into it nor write (and so replace) a folder that holds it.
  const fs::path base = fs::temp_directory_path() / ("odyssey_paths_shared_inside_" + std::to_string(getpid()));
  fs::remove_all(base);
  fs::create_directories(base / "root" / "alice" / "pub" / "models");
  const std::string alice = (base / "root" / "alice").string();
  auto policy = PathPolicy::Create({.root = (base / "root").string(), .shared_read_roots = {alice + "/pub/models"}});
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_TRUE(policy->Check(alice + "/pub/models/m", Access::kRead, "bob", "directory").ok());
  EXPECT_TRUE(policy->Check(alice + "/pub/other", Access::kWrite, "alice", "directory").ok());
  EXPECT_EQ(policy->Check(alice + "/pub/models/m", Access::kWrite, "alice", "directory").code(),
            absl::StatusCode::kPermissionDenied);
  const absl::Status above = policy->Check(alice + "/pub", Access::kWrite, "alice", "directory");
  EXPECT_EQ(above.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(above.message(), HasSubstr("it contains the shared read-only root " + alice + "/pub/models"));
  fs::remove_all(base);
}

TEST(PathPolicyOffTest, AllowsWhatWasAllowedBefore) {
  PathPolicy off;
  EXPECT_FALSE(off.enabled());
  EXPECT_TRUE(off.Check("/etc/anything", Access::kWrite, "alice", "directory").ok());
  EXPECT_TRUE(off.Check("relative/data.bin", Access::kRead, "", "spec.data.path").ok());
}

TEST_F(PathPolicyTest, RefusesOverlongPaths) {
  const std::string path = root_ + "/alice/" + std::string(kMaxCheckedPathBytes, 'a');
  EXPECT_EQ(policy_.Check(path, Access::kWrite, "alice", "directory").code(), absl::StatusCode::kInvalidArgument);
}

TEST(PathPolicyCreateTest, RefusesBadRoots) {
  const fs::path base = fs::temp_directory_path() / ("odyssey_paths_create_" + std::to_string(getpid()));
  fs::create_directories(base / "data" / "odyssey");
  auto expect_invalid = [](const PathPolicyOptions& o, const std::string& what) {
    auto p = PathPolicy::Create(o);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << what;
    return std::string(p.status().message());
  };
  EXPECT_THAT(expect_invalid({.root = "relative", .shared_read_roots = {}}, "relative root"), HasSubstr("--path-root"));
  EXPECT_THAT(expect_invalid({.root = (base / "missing").string(), .shared_read_roots = {}}, "missing root"),
              HasSubstr("must be an existing directory"));
  EXPECT_THAT(expect_invalid({.root = "", .shared_read_roots = {base.string()}}, "shared without root"),
              HasSubstr("requires --path-root"));
  EXPECT_THAT(expect_invalid({.root = (base / "data" / "odyssey").string(), .shared_read_roots = {(base / "data").string()}},
                             "shared root containing the path root"),
              HasSubstr("must not contain --path-root"));
  EXPECT_TRUE(PathPolicy::Create({.root = (base / "data" / "odyssey").string(), .shared_read_roots = {}}).ok());
  EXPECT_TRUE(PathPolicy::Create({}).ok());
  fs::remove_all(base);
}

TEST(IsUnderTest, ComparesWholeComponents) {
  EXPECT_TRUE(IsUnder("/a/b", "/a/b"));
  EXPECT_FALSE(IsUnder("/a/b", "/a/b", /*strictly=*/true));
  EXPECT_TRUE(IsUnder("/a/b/c", "/a/b", /*strictly=*/true));
  EXPECT_FALSE(IsUnder("/a/bc", "/a/b"));
  EXPECT_FALSE(IsUnder("/a", "/a/b"));
  EXPECT_TRUE(IsUnder("/a/b/c", "/"));
}

}  // namespace
}  // namespace odyssey::server
