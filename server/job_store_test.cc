#include "server/job_store.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "gmock/gmock.h"
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
  auto events = (*store)->LoadEventPage((*jobs)[0].first, 0, 100);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 2u);
  EXPECT_LT((*events)[0].first, (*events)[1].first);
  EXPECT_EQ((*events)[1].second.checkpoint(), "/ckpt/3");
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
  std::string store_id;  // it gets one (stores before meta had none), kept from then on
  for (int open = 0; open < 2; ++open) {  // the second open finds nothing left to move
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_EQ((*store)->store_id().size(), 32u);
    if (open == 0) store_id = (*store)->store_id();
    EXPECT_EQ((*store)->store_id(), store_id);
    ASSERT_EQ((*store)->LoadJobs()->size(), 1u);
    auto rids = (*store)->LoadRequestIds();
    ASSERT_TRUE(rids.ok()) << rids.status();
    ASSERT_EQ(rids->size(), 1u);
    EXPECT_EQ((*rids)[0].tenant, "");
    EXPECT_EQ((*rids)[0].request_id, "old-req");
    EXPECT_EQ((*rids)[0].job_id, 1);
  }
}

// The store's identity: random, fixed at creation, kept across opens; two stores never share it.
TEST(JobStoreTest, ANewStoreGetsAnIdentityItKeeps) {
  const std::string path = TempDb("id.db");
  std::string id;
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    id = (*store)->store_id();
    EXPECT_EQ(id.size(), 32u);
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
  }
  auto again = JobStore::Open(path);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->store_id(), id);
  auto other = JobStore::Open(TempDb("id2.db"));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE((*other)->store_id(), id);
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A file that exists but is not an odyssey store never opens as an empty store (its job ids
// would restart at 1 and reuse default checkpoint folders): refused naming the file. Only an
// empty one (0 bytes, or SQLite without tables) becomes a store, and only when asked; a file
// with other content is left untouched even then.
TEST(JobStoreTest, AFileThatIsNotAnOdysseyStoreIsRefusedUnlessEmptyAndAskedToInitialize) {
  const std::string zero = TempDb("zero.db");
  std::ofstream(zero).close();
  auto refused = JobStore::Open(zero);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::AllOf(::testing::HasSubstr("job store " + zero + " is empty (0 bytes), not an odyssey job store"),
                               ::testing::HasSubstr("--init-store")));
  EXPECT_EQ(std::filesystem::file_size(zero), 0u) << "refusing wrote to it";
  {
    auto initialized = JobStore::Open(zero, /*initialize=*/true);
    ASSERT_TRUE(initialized.ok()) << initialized.status();
    EXPECT_EQ((*initialized)->store_id().size(), 32u);
    ASSERT_TRUE((*initialized)->InsertJob(v1::Job(), "").ok());
  }
  auto reopened = JobStore::Open(zero);  // an odyssey store now: no flag needed
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ((*reopened)->LoadJobs()->size(), 1u);

  const std::string tableless = TempDb("tableless.db");  // a SQLite header, no tables
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(tableless.c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db, "PRAGMA user_version = 7;", nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(db);
  }
  auto no_tables = JobStore::Open(tableless);
  EXPECT_EQ(no_tables.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(no_tables.status().message()), ::testing::HasSubstr("a SQLite database without tables"));
  EXPECT_TRUE(JobStore::Open(tableless, /*initialize=*/true).ok());

  const std::string text = TempDb("text.db");
  std::ofstream(text) << std::string(600, 'x');
  const std::string other = TempDb("other.db");
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(other.c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db, "CREATE TABLE notes (body TEXT);", nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(db);
  }
  const struct {
    std::string path, message;
  } foreign[] = {{text, "job store " + text + " is not a SQLite database (600 bytes)"},
                 {other, "job store " + other + " is a SQLite database without odyssey's tables (it holds notes)"}};
  for (const auto& f : foreign) {
    const std::string before = Slurp(f.path);
    for (bool initialize : {false, true}) {
      auto s = JobStore::Open(f.path, initialize);
      EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << f.path << " " << initialize;
      EXPECT_THAT(std::string(s.status().message()),
                  ::testing::AllOf(::testing::HasSubstr(f.message), ::testing::HasSubstr("left untouched")));
    }
    EXPECT_EQ(Slurp(f.path), before) << f.path;
  }
}

TEST(JobStoreTest, UnopenablePathIsAnError) {
  auto store = JobStore::Open("/nonexistent-dir/odyssey/x.db");
  EXPECT_FALSE(store.ok());
}

}  // namespace
}  // namespace odyssey::server
