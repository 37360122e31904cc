#include "server/job_store.h"

#include <algorithm>
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
    // A duplicate request id is refused by the store (the controller checks first)...
    EXPECT_FALSE((*store)->InsertJob(job, "req-1").ok());
    // ...but request ids are per tenant: another tenant may use the same one.
    v1::Job bobs = job;
    bobs.set_tenant("bob");
    auto id3 = (*store)->InsertJob(bobs, "req-1");
    ASSERT_TRUE(id3.ok()) << id3.status();
    EXPECT_FALSE((*store)->InsertJob(bobs, "req-1").ok());
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok());
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 3u);
  EXPECT_EQ((*jobs)[0].second.state(), v1::Job::RUNNING);
  EXPECT_EQ((*jobs)[0].second.step(), 3);
  EXPECT_EQ((*jobs)[1].second.state(), v1::Job::PENDING);
  EXPECT_EQ((*jobs)[2].second.tenant(), "bob");
  auto rids = (*store)->LoadRequestIds();
  ASSERT_TRUE(rids.ok()) << rids.status();
  ASSERT_EQ(rids->size(), 2u);
  std::sort(rids->begin(), rids->end(), [](const auto& a, const auto& b) { return a.tenant < b.tenant; });
  EXPECT_EQ((*rids)[0].tenant, "");
  EXPECT_EQ((*rids)[0].request_id, "req-1");
  EXPECT_EQ((*rids)[0].job_id, (*jobs)[0].first);
  EXPECT_EQ((*rids)[1].tenant, "bob");
  EXPECT_EQ((*rids)[1].request_id, "req-1");
  EXPECT_EQ((*rids)[1].job_id, (*jobs)[2].first);
  auto events = (*store)->LoadEvents((*jobs)[0].first);
  ASSERT_EQ(events->size(), 2u);
  EXPECT_EQ((*events)[1].checkpoint(), "/ckpt/3");
  auto ckpts = (*store)->LoadCheckpoints((*jobs)[0].first);
  ASSERT_EQ(ckpts->size(), 1u);
  EXPECT_EQ((*ckpts)[0].second, "/ckpt/3");
}

// A store written before tenants (request ids in `request_ids`) opens with its request ids
// intact, as the anonymous tenant's.
TEST(JobStoreTest, RequestIdsOfAnOlderStoreBecomeTheAnonymousTenants) {
  const std::string path = TempDb("old.db");
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    v1::Job job;
    job.set_state(v1::Job::SUCCEEDED);
    const std::string blob = job.SerializeAsString();
    ASSERT_EQ(sqlite3_exec(db,
                           "CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, state INTEGER NOT NULL, "
                           "priority INTEGER NOT NULL, job BLOB NOT NULL);"
                           "CREATE TABLE request_ids (request_id TEXT PRIMARY KEY, job_id INTEGER NOT NULL);"
                           "INSERT INTO request_ids VALUES ('old-req', 1);",
                           nullptr, nullptr, nullptr),
              SQLITE_OK);
    sqlite3_stmt* insert = nullptr;
    ASSERT_EQ(sqlite3_prepare_v2(db, "INSERT INTO jobs (state, priority, job) VALUES (3, 0, ?);", -1, &insert, nullptr),
              SQLITE_OK);
    sqlite3_bind_blob(insert, 1, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
    ASSERT_EQ(sqlite3_step(insert), SQLITE_DONE);
    sqlite3_finalize(insert);
    sqlite3_close(db);
  }
  for (int open = 0; open < 2; ++open) {  // the second open finds nothing left to move
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    auto rids = (*store)->LoadRequestIds();
    ASSERT_TRUE(rids.ok()) << rids.status();
    ASSERT_EQ(rids->size(), 1u);
    EXPECT_EQ((*rids)[0].tenant, "");
    EXPECT_EQ((*rids)[0].request_id, "old-req");
    EXPECT_EQ((*rids)[0].job_id, 1);
  }
}

TEST(JobStoreTest, UnopenablePathIsAnError) {
  auto store = JobStore::Open("/nonexistent-dir/odyssey/x.db");
  EXPECT_FALSE(store.ok());
}

}  // namespace
}  // namespace odyssey::server
