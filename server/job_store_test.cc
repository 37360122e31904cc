#include "server/job_store.h"

#include <filesystem>

#include "gtest/gtest.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;

std::string TempDb(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("odyssey_job_store_test_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto path = dir / name;
  std::filesystem::remove(path);
  return path.string();
}

TEST(JobStoreTest, JobsEventsCheckpointsAndRequestIdsSurviveReopen) {
  const std::string path = TempDb("a.db");
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    v1::Job job;
    job.mutable_spec()->set_steps(5);
    job.set_state(v1::Job::PENDING);
    auto id1 = (*store)->InsertJob(job, "req-1");
    auto id2 = (*store)->InsertJob(job, "");
    ASSERT_TRUE(id1.ok() && id2.ok());
    EXPECT_LT(*id1, *id2);
    job.set_state(v1::Job::RUNNING);
    job.set_step(3);
    ASSERT_TRUE((*store)->UpdateJob(*id1, job).ok());
    EXPECT_EQ((*store)->UpdateJob(999, job).code(), absl::StatusCode::kNotFound);
    v1::JobEvent e;
    e.set_state(v1::Job::RUNNING);
    ASSERT_TRUE((*store)->AppendEvent(*id1, e).ok());
    e.set_checkpoint("/ckpt/3");
    ASSERT_TRUE((*store)->AppendEvent(*id1, e).ok());
    ASSERT_TRUE((*store)->AddCheckpoint(*id1, 3, "/ckpt/3").ok());
    // A duplicate request id is refused by the store (the controller checks first).
    EXPECT_FALSE((*store)->InsertJob(job, "req-1").ok());
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok());
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 2u);
  EXPECT_EQ((*jobs)[0].second.state(), v1::Job::RUNNING);
  EXPECT_EQ((*jobs)[0].second.step(), 3);
  EXPECT_EQ((*jobs)[1].second.state(), v1::Job::PENDING);
  auto rids = (*store)->LoadRequestIds();
  ASSERT_EQ(rids->size(), 1u);
  EXPECT_EQ((*rids)[0].first, "req-1");
  EXPECT_EQ((*rids)[0].second, (*jobs)[0].first);
  auto events = (*store)->LoadEvents((*jobs)[0].first);
  ASSERT_EQ(events->size(), 2u);
  EXPECT_EQ((*events)[1].checkpoint(), "/ckpt/3");
  auto ckpts = (*store)->LoadCheckpoints((*jobs)[0].first);
  ASSERT_EQ(ckpts->size(), 1u);
  EXPECT_EQ((*ckpts)[0].second, "/ckpt/3");
}

TEST(JobStoreTest, UnopenablePathIsAnError) {
  auto store = JobStore::Open("/nonexistent-dir/odyssey/x.db");
  EXPECT_FALSE(store.ok());
}

}  // namespace
}  // namespace odyssey::server
