#include "common/files.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace odyssey {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// The names in `dir`: what a writer left behind, temporaries included (they are hidden or
// suffixed, never elsewhere).
std::vector<std::string> Names(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Runs `fn` where `dir` cannot be written: `dir` is made read-only, and as root (who ignores
// permissions) `fn` runs in a child process that drops to the unprivileged user nobody. The
// status comes back as its code and message.
absl::Status RunWithReadOnlyFolder(const fs::path& dir, const std::function<absl::Status()>& fn) {
  fs::permissions(dir, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                           fs::perms::group_exec | fs::perms::others_read | fs::perms::others_exec);
  absl::Status result;
  if (::geteuid() != 0) {
    result = fn();
  } else {
    int pipe_fds[2];
    if (::pipe(pipe_fds) != 0) return absl::InternalError("pipe failed");
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(pipe_fds[0]);
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(100);
      const absl::Status s = fn();
      const std::string message(s.message());
      if (::write(pipe_fds[1], message.data(), message.size()) < 0) ::_exit(101);
      ::_exit(static_cast<int>(s.code()));
    }
    ::close(pipe_fds[1]);
    std::string message;
    char buf[256];
    for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof(buf))) > 0;) message.append(buf, static_cast<size_t>(n));
    ::close(pipe_fds[0]);
    int wstatus = 0;
    ::waitpid(pid, &wstatus, 0);
    const int code = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 102;
    result = code >= 100 ? absl::InternalError(absl::StrCat("child failed (", code, ")"))
                         : absl::Status(static_cast<absl::StatusCode>(code), message);
  }
  fs::permissions(dir, fs::perms::owner_all, fs::perm_options::add);
  return result;
}

class FilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / absl::StrCat("odyssey_files_test_", ::getpid(), "_", info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // A child dropped to nobody must reach dir_ to be refused by it (and not by /tmp's parents).
    fs::permissions(dir_, fs::perms::all);
    fs::permissions(dir_, fs::perms::others_write | fs::perms::group_write, fs::perm_options::remove);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(FilesTest, WritesAStringAndLeavesNoTemporary) {
  const std::string path = (dir_ / "port").string();
  ASSERT_TRUE(WriteFileAtomically(path, "1234\n").ok());
  EXPECT_EQ(ReadFile(path), "1234\n");
  ASSERT_TRUE(WriteFileAtomically(path, std::string("5678\n")).ok());
  EXPECT_EQ(ReadFile(path), "5678\n");
  EXPECT_THAT(Names(dir_), ElementsAre("port"));
}

TEST_F(FilesTest, EmptyAndBinaryContents) {
  const std::string path = (dir_ / "f").string();
  ASSERT_TRUE(WriteFileAtomically(path, "").ok());
  EXPECT_TRUE(fs::exists(path));
  EXPECT_EQ(fs::file_size(path), 0u);
  const std::string binary("a\0b\n\r\xff", 6);
  ASSERT_TRUE(WriteFileAtomically(path, binary).ok());
  EXPECT_EQ(ReadFile(path), binary);
}

TEST_F(FilesTest, StreamsAppendsInOrder) {
  const std::string path = (dir_ / "big.bin").string();
  std::string chunk(3 << 20, '\0');  // larger than one write() is guaranteed to take
  for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<char>(i * 7 + 3);
  const uint64_t header = 0x0102030405060708;
  std::string temp_seen;
  absl::Status s = WriteFileAtomically(path, [&](FileSink& out) -> absl::Status {
    temp_seen = out.temp_path();
    if (absl::Status a = out.Append(&header, sizeof(header)); !a.ok()) return a;
    if (absl::Status a = out.Append(chunk); !a.ok()) return a;
    return out.Append("end");
  });
  ASSERT_TRUE(s.ok()) << s;
  const std::string got = ReadFile(path);
  ASSERT_EQ(got.size(), sizeof(header) + chunk.size() + 3);
  EXPECT_EQ(got.substr(0, sizeof(header)), std::string(reinterpret_cast<const char*>(&header), sizeof(header)));
  EXPECT_TRUE(got.compare(sizeof(header), chunk.size(), chunk) == 0);
  EXPECT_EQ(got.substr(got.size() - 3), "end");
  // The temporary sat beside the target, and is gone.
  EXPECT_EQ(fs::path(temp_seen).parent_path(), dir_);
  EXPECT_NE(temp_seen, path);
  EXPECT_THAT(Names(dir_), ElementsAre("big.bin"));
}

TEST_F(FilesTest, CallbackErrorIsReturnedAndPublishesNothing) {
  const std::string path = (dir_ / "state.json").string();
  WriteFile(path, "old");
  absl::Status s = WriteFileAtomically(path, [](FileSink& out) -> absl::Status {
    if (absl::Status a = out.Append("half of the new"); !a.ok()) return a;
    return absl::DataLossError("tensor 'w': cannot copy to the CPU");
  });
  EXPECT_EQ(s, absl::DataLossError("tensor 'w': cannot copy to the CPU"));
  EXPECT_EQ(ReadFile(path), "old");
  EXPECT_THAT(Names(dir_), ElementsAre("state.json"));
}

TEST_F(FilesTest, UnwritableFolderNamesPathAndOperationAndKeepsTheOldFile) {
  const fs::path sub = dir_ / "ro";
  fs::create_directories(sub);
  const std::string path = (sub / "port").string();
  WriteFile(path, "old\n");
  const absl::Status s = RunWithReadOnlyFolder(sub, [&] { return WriteFileAtomically(path, "new\n"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr(path + ": cannot create temporary file " + path + ".tmp."));
  EXPECT_THAT(s.message(), HasSubstr("Permission denied"));
  EXPECT_EQ(ReadFile(path), "old\n");
  EXPECT_THAT(Names(sub), ElementsAre("port"));
}

TEST_F(FilesTest, MissingFolderIsNotFound) {
  const std::string path = (dir_ / "no" / "such" / "file").string();
  const absl::Status s = WriteFileAtomically(path, "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr(path + ": cannot create temporary file"));
}

TEST_F(FilesTest, FailedRenameRemovesTheTemporaryAndKeepsTheTarget) {
  // A non-empty folder at the target: the rename is refused after the file was written.
  const fs::path target = dir_ / "model.safetensors";
  fs::create_directories(target);
  WriteFile(target / "keep", "kept");
  const absl::Status s = WriteFileAtomically(target.string(), "data");
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr(target.string() + ": cannot rename temporary file"));
  EXPECT_EQ(ReadFile(target / "keep"), "kept");
  EXPECT_THAT(Names(dir_), ElementsAre("model.safetensors"));
}

TEST_F(FilesTest, ConcurrentWritersOfOneTargetEachWriteAWholeFile) {
  // With one temporary name per target the writers would truncate and rename each other's
  // files; each gets its own, and the survivor is one writer's whole text.
  const std::string path = (dir_ / "cache").string();
  constexpr int kWriters = 8;
  std::vector<std::string> texts;
  for (int i = 0; i < kWriters; ++i) texts.push_back(std::string(100000 + i, static_cast<char>('a' + i)));
  std::vector<absl::Status> results(kWriters);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWriters; ++i)
    threads.emplace_back([&, i] {
      for (int round = 0; round < 5 && results[i].ok(); ++round) results[i] = WriteFileAtomically(path, texts[i]);
    });
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  const std::string got = ReadFile(path);
  EXPECT_THAT(texts, ::testing::Contains(got));
  EXPECT_THAT(Names(dir_), ElementsAre("cache"));
}

TEST_F(FilesTest, PublishCreatesTheFolder) {
  const fs::path target = dir_ / "ckpt" / "step-00000002";  // the parent is created too
  absl::StatusOr<StagedFolder> staged = StagedFolder::Create(target.string());
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->target(), target.string());
  EXPECT_EQ(fs::path(staged->path()).parent_path(), target.parent_path());
  EXPECT_TRUE(fs::is_directory(staged->path()));
  EXPECT_FALSE(fs::exists(target));  // nothing visible before Publish
  ASSERT_TRUE(WriteFileAtomically((fs::path(staged->path()) / "config.json").string(), "{}\n").ok());
  fs::create_directories(fs::path(staged->path()) / "sub");
  WriteFile(fs::path(staged->path()) / "sub" / "x", "nested");
  ASSERT_TRUE(staged->Publish().ok());
  EXPECT_EQ(ReadFile(target / "config.json"), "{}\n");
  EXPECT_EQ(ReadFile(target / "sub" / "x"), "nested");
  EXPECT_THAT(Names(target.parent_path()), ElementsAre("step-00000002"));
  EXPECT_THAT(Names(target), UnorderedElementsAre("config.json", "sub"));
  EXPECT_FALSE(staged->Publish().ok());  // once only
}

TEST_F(FilesTest, PublishReplacesTheOldFolder) {
  const fs::path target = dir_ / "export";
  fs::create_directories(target / "old_sub");
  WriteFile(target / "config.json", "old");
  WriteFile(target / "old_only.txt", "stale");
  absl::StatusOr<StagedFolder> staged = StagedFolder::Create(target.string() + "/");  // a trailing slash
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->target(), target.string());
  WriteFile(fs::path(staged->path()) / "config.json", "new");
  // Until Publish the old folder is what readers see.
  EXPECT_EQ(ReadFile(target / "config.json"), "old");
  const absl::Status s = staged->Publish();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_THAT(Names(target), ElementsAre("config.json"));  // the old folder's files are gone
  EXPECT_EQ(ReadFile(target / "config.json"), "new");
  EXPECT_THAT(Names(dir_), ElementsAre("export"));  // no staging, no old folder left over
}

TEST_F(FilesTest, AbandonedStagingIsRemovedAndTheOldFolderKept) {
  const fs::path target = dir_ / "step-00000004";
  fs::create_directories(target);
  WriteFile(target / "model.safetensors", "old weights");
  std::string staging;
  {
    absl::StatusOr<StagedFolder> staged = StagedFolder::Create(target.string());
    ASSERT_TRUE(staged.ok()) << staged.status();
    staging = staged->path();
    WriteFile(fs::path(staging) / "model.safetensors", "half");
    EXPECT_THAT(Names(dir_), ::testing::SizeIs(2));
    // The caller's save failed: it returns without publishing.
  }
  EXPECT_FALSE(fs::exists(staging));
  EXPECT_THAT(Names(dir_), ElementsAre("step-00000004"));
  EXPECT_EQ(ReadFile(target / "model.safetensors"), "old weights");
}

TEST_F(FilesTest, MovedStagingIsCleanedUpOnceByItsLastOwner) {
  const fs::path target = dir_ / "out";
  absl::StatusOr<StagedFolder> staged = StagedFolder::Create(target.string());
  ASSERT_TRUE(staged.ok());
  StagedFolder owner = *std::move(staged);
  { StagedFolder dropped = std::move(owner); }
  EXPECT_THAT(Names(dir_), ::testing::IsEmpty());
}

TEST_F(FilesTest, StagingNamesAreUniquePerCall) {
  const std::string target = (dir_ / "step-00000001").string();
  absl::StatusOr<StagedFolder> a = StagedFolder::Create(target);
  absl::StatusOr<StagedFolder> b = StagedFolder::Create(target);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->path(), b->path());
  EXPECT_EQ(fs::path(a->path()).filename().string().rfind(".step-00000001.tmp-", 0), 0u) << a->path();
}

TEST_F(FilesTest, FailedCreateInAnUnwritableParentLeavesTheOldFolder) {
  const fs::path parent = dir_ / "ro";
  const fs::path target = parent / "export";
  fs::create_directories(target);
  WriteFile(target / "config.json", "old");
  const absl::Status s = RunWithReadOnlyFolder(parent, [&] { return StagedFolder::Create(target.string()).status(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr(target.string() + ": cannot create staging folder " + parent.string() + "/.export.tmp-"));
  EXPECT_THAT(Names(parent), ElementsAre("export"));
  EXPECT_EQ(ReadFile(target / "config.json"), "old");
}

TEST_F(FilesTest, FailedPublishLeavesNoStagingAndTheOldFolder) {
  const fs::path parent = dir_ / "ro";
  const fs::path target = parent / "export";
  fs::create_directories(target);
  WriteFile(target / "config.json", "old");
  {
    absl::StatusOr<StagedFolder> staged = StagedFolder::Create(target.string());
    ASSERT_TRUE(staged.ok()) << staged.status();
    WriteFile(fs::path(staged->path()) / "config.json", "new");
    // The parent turns read-only between the save and the publish: the rename is refused.
    const absl::Status s = RunWithReadOnlyFolder(parent, [&] { return staged->Publish(); });
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(s.message(), HasSubstr(target.string() + ": cannot exchange staging folder " + staged->path()));
    EXPECT_EQ(ReadFile(target / "config.json"), "old");
  }
  EXPECT_THAT(Names(parent), ElementsAre("export"));
  EXPECT_EQ(ReadFile(target / "config.json"), "old");
}

TEST_F(FilesTest, ParentThatIsAFileIsAnError) {
  WriteFile(dir_ / "file", "x");
  const std::string target = (dir_ / "file" / "ckpt").string();
  absl::StatusOr<StagedFolder> staged = StagedFolder::Create(target);
  ASSERT_FALSE(staged.ok());
  EXPECT_THAT(staged.status().message(), HasSubstr(target + ": cannot create parent folder " + (dir_ / "file").string()));
  EXPECT_EQ(ReadFile(dir_ / "file"), "x");
}

TEST_F(FilesTest, ReadingAFifoNeverBlocks) {
  const std::string fifo = (dir_ / "pipe").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // No writer ever opens it: a blocking open would wait forever (the test's deadline is ctest's).
  const absl::Status s = CheckRegularFile(fifo);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr(fifo + ": is a FIFO, not a regular file"));
  EXPECT_EQ(ReadRegularFile(fifo, 100).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(CheckRegularFile(dir_.string()).message(), HasSubstr("is a directory"));
  EXPECT_EQ(CheckRegularFile((dir_ / "missing").string()).code(), absl::StatusCode::kNotFound);
}

TEST_F(FilesTest, ReadRegularFileReadsAndBoundsTheSize) {
  WriteFile(dir_ / "f", "hello");
  EXPECT_EQ(*ReadRegularFile((dir_ / "f").string(), 5), "hello");
  EXPECT_EQ(ReadRegularFile((dir_ / "f").string(), 4).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(CheckRegularFile((dir_ / "f").string()).ok());
}

}  // namespace
}  // namespace odyssey
