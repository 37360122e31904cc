#include "worker/checkpoint_folder.h"

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace odyssey::worker {
namespace {
namespace fs = std::filesystem;

constexpr char kMine[] = "0123456789abcdef0123456789abcdef/jobs/1";
constexpr char kTheirs[] = "fedcba9876543210fedcba9876543210/jobs/1";  // job 1 of another store

class CheckpointFolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("odyssey_ckpt_folder_test_" + std::to_string(getpid()) + "_" +
                                          ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // A published step folder of `owner` ("" = no owner file, as an older odyssey wrote them).
  std::string Step(int64_t step, const std::string& owner) {
    const std::string path = CheckpointPath(dir_, step);
    fs::create_directories(path);
    std::ofstream(fs::path(path) / "model.safetensors") << "weights";
    if (!owner.empty()) {
      EXPECT_TRUE(WriteOwner(path, owner).ok());
    }
    return path;
  }
  std::string dir_;
};

TEST_F(CheckpointFolderTest, OwnerRoundTrips) {
  const std::string step = Step(3, kMine);
  EXPECT_EQ(ReadOwner(step), kMine);
  EXPECT_EQ(ReadOwner(Step(4, "")), "");
  EXPECT_EQ(ReadOwner(dir_ + "/missing"), "");
}

TEST_F(CheckpointFolderTest, AFolderIsTakenOnlyWhenItsStepsAreOwn) {
  EXPECT_TRUE(CheckCheckpointFolder(dir_ + "/not-yet", kMine, "spec.checkpoint.directory").ok());
  EXPECT_TRUE(CheckCheckpointFolder(dir_, kMine, "spec.checkpoint.directory").ok());  // empty
  Step(2, kMine);
  Step(4, kMine);
  EXPECT_TRUE(CheckCheckpointFolder(dir_, kMine, "spec.checkpoint.directory").ok());  // a restart of the same job

  Step(300, kTheirs);
  absl::Status s = CheckCheckpointFolder(dir_, kMine, "spec.checkpoint.directory");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("spec.checkpoint.directory: checkpoint folder \"" + dir_ + "\""), std::string::npos) << s;
  EXPECT_NE(s.message().find("step-00000300 of another job"), std::string::npos) << s;
  EXPECT_NE(s.message().find("choose a new checkpoint.directory"), std::string::npos) << s;
  EXPECT_EQ(s.message().find(kTheirs), std::string::npos) << "names the other job: " << s;

  fs::remove_all(CheckpointPath(dir_, 300));
  Step(200, "");
  s = CheckCheckpointFolder(dir_, kMine, "spec.checkpoint.directory");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("step-00000200 without an owner file"), std::string::npos) << s;
}

TEST_F(CheckpointFolderTest, PruningCountsAndRemovesOnlyOwnSteps) {
  const std::string theirs2 = Step(2, kTheirs), theirs9 = Step(9, kTheirs), legacy = Step(1, "");
  for (int64_t step : {3, 5, 7, 8}) Step(step, kMine);
  PruneCheckpoints(dir_, kMine, 2);
  EXPECT_EQ(ListCheckpoints(dir_), (std::vector<std::string>{legacy, theirs2, CheckpointPath(dir_, 7),
                                                             CheckpointPath(dir_, 8), theirs9}));
  PruneCheckpoints(dir_, kMine, 0);  // keep all
  EXPECT_EQ(ListCheckpoints(dir_).size(), 5u);
}

// A prune killed halfway through removing a step folder (here: after its owner file, which
// remove_all may take first) leaves no step folder without an owner: the job's restart takes its
// folder, and the leftover, still named a pruned step, is a staging leftover (cleared once its
// owner is known, or once old without one).
TEST_F(CheckpointFolderTest, APruneKilledMidRemovalLeavesNoOwnerlessStep) {
  for (int64_t step : {6, 7, 8}) Step(step, kMine);
  std::vector<std::string> removed;
  PruneCheckpoints(dir_, kMine, 2, [&removed](const std::string& path) {
    fs::remove(fs::path(path) / kOwnerFile);  // and then the process dies
    removed.push_back(path);
  });
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(fs::path(removed[0]).filename().string(), ".step-00000006.pruned");
  EXPECT_EQ(ListCheckpoints(dir_), (std::vector<std::string>{CheckpointPath(dir_, 7), CheckpointPath(dir_, 8)}));
  EXPECT_TRUE(CheckCheckpointFolder(dir_, kMine, "spec.checkpoint.directory").ok());
  fs::last_write_time(removed[0], fs::file_time_type::clock::now() - kOwnerlessStagingAge - std::chrono::minutes(1));
  RemoveStagingLeftovers(dir_, kMine);
  EXPECT_FALSE(fs::exists(removed[0]));
  // Killed before the removal began: the leftover keeps its owner and goes as the job's own;
  // the next prune of the same step name replaces any leftover of it.
  Step(9, kMine);
  PruneCheckpoints(dir_, kMine, 2, [](const std::string&) {});
  EXPECT_EQ(ReadOwner(dir_ + "/.step-00000007.pruned"), kMine);
  RemoveStagingLeftovers(dir_, kMine);
  EXPECT_FALSE(fs::exists(dir_ + "/.step-00000007.pruned"));
  PruneCheckpoints(dir_, kMine, 1);
  EXPECT_EQ(ListCheckpoints(dir_), std::vector<std::string>{CheckpointPath(dir_, 9)});
  EXPECT_FALSE(fs::exists(dir_ + "/.step-00000008.pruned"));
}

// A restart resumes from the job's newest own step folder, also when the controller's recorded
// one was pruned by a run it had lost track of; never from another owner's, never back in time.
TEST_F(CheckpointFolderTest, RestartResumesFromTheNewestOwnStep) {
  const std::string recorded = Step(4, kMine);
  EXPECT_EQ(RestartCheckpoint(dir_, kMine, recorded), recorded);  // nothing newer
  Step(6, kMine);
  Step(9, kTheirs);  // newer, but another job's
  EXPECT_EQ(RestartCheckpoint(dir_, kMine, recorded), CheckpointPath(dir_, 6));
  PruneCheckpoints(dir_, kMine, 1);  // the lost run's keep-1 removed the recorded step-4
  ASSERT_FALSE(fs::exists(recorded));
  EXPECT_EQ(RestartCheckpoint(dir_, kMine, recorded), CheckpointPath(dir_, 6));
  // A recorded step newer than any own folder here (written elsewhere) stays.
  const std::string elsewhere = (fs::path(dir_) / "other" / "step-00000012").string();
  fs::create_directories(elsewhere);
  EXPECT_EQ(RestartCheckpoint(dir_, kMine, elsewhere), elsewhere);
  // A recorded folder of another name (an RL session's save) that still exists stays.
  const std::string saved = (fs::path(dir_) / "my-save").string();
  fs::create_directories(saved);
  EXPECT_EQ(RestartCheckpoint(dir_, kMine, saved), saved);
  EXPECT_EQ(RestartCheckpoint(dir_, kMine, saved + "-gone"), CheckpointPath(dir_, 6));
  EXPECT_EQ(RestartCheckpoint(dir_ + "/missing", kMine, recorded), recorded);  // no folder: as recorded
}

TEST_F(CheckpointFolderTest, OnlyEmptyOrOwnFoldersAreReplaced) {
  EXPECT_TRUE(CheckReplaceable(dir_ + "/new", kMine, "directory").ok());
  fs::create_directories(dir_ + "/empty");
  EXPECT_TRUE(CheckReplaceable(dir_ + "/empty", kMine, "directory").ok());
  EXPECT_TRUE(CheckReplaceable(Step(5, kMine), kMine, "directory").ok());
  for (const std::string& other : {Step(6, kTheirs), Step(7, "")}) {
    absl::Status s = CheckReplaceable(other, kMine, "directory");
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << other;
    EXPECT_NE(s.message().find("directory: \"" + other + "\" exists and is not this job's"), std::string::npos) << s;
  }
  std::ofstream(dir_ + "/a-file") << "x";
  EXPECT_EQ(CheckReplaceable(dir_ + "/a-file", kMine, "directory").code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CheckpointFolderTest, StagingLeftoversOfOthersStay) {
  auto staging = [this](const std::string& name, const std::string& owner) {
    const std::string path = dir_ + "/" + name;
    fs::create_directories(path);
    if (!owner.empty()) {
      EXPECT_TRUE(WriteOwner(path, owner).ok());
    }
    return path;
  };
  const std::string mine = staging(".step-00000004.tmp-1.1", kMine);
  const std::string legacy = staging(".step-00000004.tmp-1.2", "");
  fs::last_write_time(legacy, fs::file_time_type::clock::now() - kOwnerlessStagingAge - std::chrono::minutes(1));
  const std::string theirs = staging(".step-00000004.tmp-2.1", kTheirs);  // another live job's write
  // Another live job's folder in the moment between its creation and its owner file.
  const std::string fresh = staging(".step-00000004.tmp-3.1", "");
  RemoveStagingLeftovers(dir_, kMine);
  EXPECT_FALSE(fs::exists(mine));
  EXPECT_FALSE(fs::exists(legacy));
  EXPECT_TRUE(fs::exists(theirs));
  EXPECT_TRUE(fs::exists(fresh));
}

// A run the controller gave up on (its worker was stopped mid-write) comes back after a newer
// run of the same job removed its staging folder as a leftover and writes on into that path: the
// folder it would publish has no owner file, so it is not published (published, it would sit in
// the checkpoint folder as nobody's step, which the newer run must then refuse to replace: the
// soak's seed 63942 failed a job so). An intact staging folder publishes.
TEST_F(CheckpointFolderTest, AStagingFolderRemovedByANewerRunIsNotPublished) {
  const std::string target = CheckpointPath(dir_, 20);
  {
    absl::StatusOr<StagedFolder> stale = StagedFolder::Create(target);
    ASSERT_TRUE(stale.ok()) << stale.status();
    ASSERT_TRUE(WriteOwner(stale->path(), kMine).ok());
    RemoveStagingLeftovers(dir_, kMine);  // the newer run starts
    ASSERT_FALSE(fs::exists(stale->path()));
    fs::create_directories(stale->path());  // the stale run's writer recreates it and writes on
    std::ofstream(fs::path(stale->path()) / "model.safetensors") << "weights";
    const absl::Status s = PublishOwned(*stale, kMine, "checkpoint");
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_NE(s.message().find("checkpoint: \"" + target + "\" not published"), std::string::npos) << s;
    EXPECT_FALSE(fs::exists(target));
  }
  EXPECT_TRUE(ListCheckpoints(dir_).empty());
  EXPECT_TRUE(CheckReplaceable(target, kMine, "checkpoint").ok()) << "the newer run can write step 20";
  absl::StatusOr<StagedFolder> fresh = StagedFolder::Create(target);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_TRUE(WriteOwner(fresh->path(), kMine).ok());
  ASSERT_TRUE(PublishOwned(*fresh, kMine, "checkpoint").ok());
  EXPECT_EQ(ReadOwner(target), kMine);
}

}  // namespace
}  // namespace odyssey::worker
