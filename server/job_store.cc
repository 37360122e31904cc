#include "server/job_store.h"

#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;

// Finalizes a prepared statement when it goes out of scope.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) { rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr); }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;
  bool ok() const { return rc_ == SQLITE_OK; }
  sqlite3_stmt* get() { return stmt_; }
  void BindInt(int i, int64_t v) { sqlite3_bind_int64(stmt_, i, v); }
  void BindText(int i, const std::string& v) {
    sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  void BindBlob(int i, const std::string& v) {
    sqlite3_bind_blob(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  int Step() { return sqlite3_step(stmt_); }
  std::string ColumnBytes(int i) {
    const void* p = sqlite3_column_blob(stmt_, i);
    return std::string(static_cast<const char*>(p), sqlite3_column_bytes(stmt_, i));
  }
  int64_t ColumnInt(int i) { return sqlite3_column_int64(stmt_, i); }

 private:
  sqlite3_stmt* stmt_ = nullptr;
  int rc_ = SQLITE_ERROR;
};

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS meta (
  key TEXT PRIMARY KEY,        -- 'store_id': the store's identity (32 hex digits)
  value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  state INTEGER NOT NULL,
  priority INTEGER NOT NULL,
  job BLOB NOT NULL            -- odyssey.v1.Job, serialized
);
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id INTEGER NOT NULL,
  event BLOB NOT NULL          -- odyssey.v1.JobEvent, serialized
);
CREATE INDEX IF NOT EXISTS events_by_job ON events(job_id, seq);
CREATE TABLE IF NOT EXISTS checkpoints (
  job_id INTEGER NOT NULL,
  step INTEGER NOT NULL,
  directory TEXT NOT NULL,
  PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS tenant_request_ids (
  tenant TEXT NOT NULL,        -- the job's owner ('' = anonymous: auth off)
  request_id TEXT NOT NULL,
  job_id INTEGER NOT NULL,
  PRIMARY KEY (tenant, request_id)
);
)sql";

// Stores written before tenants kept request ids in `request_ids (request_id PRIMARY KEY,
// job_id)`: those jobs belong to the anonymous tenant. Moved once, in one transaction.
constexpr const char* kMigrateRequestIds = R"sql(
BEGIN IMMEDIATE;
INSERT OR IGNORE INTO tenant_request_ids (tenant, request_id, job_id) SELECT '', request_id, job_id FROM request_ids;
DROP TABLE request_ids;
COMMIT;
)sql";

// What an existing file holds, judged before anything is written to it.
enum class Contents { kOdyssey, kEmpty, kOtherSqlite, kNotSqlite };
struct Inspection {
  Contents contents = Contents::kEmpty;
  std::vector<std::string> tables;  // kOtherSqlite: what it holds instead
};

// Reads the table names only: no pragma that writes (journal_mode=WAL would turn an empty file
// into a database) runs before the verdict.
absl::StatusOr<Inspection> Inspect(sqlite3* db, const std::string& path) {
  Inspection out;
  {
    Statement tables(db, "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name;");
    if (!tables.ok()) {
      if (sqlite3_errcode(db) == SQLITE_NOTADB) {
        out.contents = Contents::kNotSqlite;
        return out;
      }
      return absl::UnavailableError(absl::StrCat("job store ", path, ": cannot read it: ", sqlite3_errmsg(db)));
    }
    int rc;
    while ((rc = tables.Step()) == SQLITE_ROW) out.tables.push_back(tables.ColumnBytes(0));
    if (rc == SQLITE_NOTADB) {
      out.contents = Contents::kNotSqlite;
      return out;
    }
    if (rc != SQLITE_DONE)
      return absl::UnavailableError(absl::StrCat("job store ", path, ": cannot read it: ", sqlite3_errmsg(db)));
  }
  if (out.tables.empty()) return out;  // kEmpty
  Statement columns(db,
                    "SELECT COUNT(*) FROM pragma_table_info('jobs') WHERE name IN ('id', 'state', 'priority', 'job');");
  const bool odyssey = columns.ok() && columns.Step() == SQLITE_ROW && columns.ColumnInt(0) == 4;
  out.contents = odyssey ? Contents::kOdyssey : Contents::kOtherSqlite;
  return out;
}

// 128 random bits as 32 lowercase hex digits.
std::string NewStoreId() {
  std::random_device rd;
  auto word = [&rd] { return (static_cast<uint64_t>(rd()) << 32) | rd(); };
  const uint64_t hi = word(), lo = word();
  return absl::StrFormat("%016x%016x", hi, lo);
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path, bool initialize) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(path, ec);
  // Only a missing file is created: an existing one is judged first.
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(path.c_str(), &db,
                           SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX | (exists ? 0 : SQLITE_OPEN_CREATE), nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close(db);
    return absl::UnavailableError(absl::StrCat("cannot open job store ", path, ": ", msg));
  }
  std::unique_ptr<JobStore> store(new JobStore(db));
  absl::MutexLock lock(&store->mu_);
  sqlite3_busy_timeout(db, 5000);
  bool initialized = false;
  if (exists) {
    absl::StatusOr<Inspection> found = Inspect(db, path);
    if (!found.ok()) return found.status();
    const uintmax_t size = std::filesystem::file_size(path, ec);
    const std::string bytes = ec ? std::string("?") : absl::StrCat(size);
    switch (found->contents) {
      case Contents::kOdyssey:
        break;
      case Contents::kEmpty:
        if (!initialize) {
          return absl::FailedPreconditionError(absl::StrCat(
              "job store ", path, " is ", size == 0 ? "empty (0 bytes)" : "a SQLite database without tables",
              ", not an odyssey job store: if it held this controller's jobs, they are lost (restore it from a "
              "backup; starting over would reuse job ids and their default checkpoint folders); to make it a new, "
              "empty job store, start odyssey-controller with --init-store"));
        }
        initialized = true;
        break;
      case Contents::kNotSqlite:
        return absl::FailedPreconditionError(absl::StrCat(
            "job store ", path, " is not a SQLite database (", bytes,
            " bytes), so not an odyssey job store; it was left untouched (--init-store never overwrites a file "
            "with content): move it away or choose another --state-dir"));
      case Contents::kOtherSqlite:
        return absl::FailedPreconditionError(absl::StrCat(
            "job store ", path, " is a SQLite database without odyssey's tables (it holds ",
            absl::StrJoin(found->tables, ", "),
            "), not an odyssey job store; it was left untouched (--init-store never adds to a file with content): "
            "move it away or choose another --state-dir"));
    }
  }
  for (const char* sql : {"PRAGMA journal_mode=WAL;", "PRAGMA synchronous=NORMAL;", kSchema}) {
    if (absl::Status s = store->Exec(sql); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("job store ", path, ": ", s.message()));
    }
  }
  bool has_old_table = false;
  {
    Statement old_table(db, "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'request_ids';");
    if (!old_table.ok()) return store->Error("prepare schema check");
    has_old_table = old_table.Step() == SQLITE_ROW;
  }  // finalized before the migration drops the table
  if (has_old_table) {
    if (absl::Status s = store->Exec(kMigrateRequestIds); !s.ok()) {
      (void)store->Exec("ROLLBACK;");
      return absl::Status(s.code(), absl::StrCat("job store ", path, ": moving request ids to tenant_request_ids: ",
                                                 s.message()));
    }
  }
  bool migrated = false;  // an odyssey store written before store ids
  if (exists && !initialized) {
    Statement had_id(db, "SELECT 1 FROM meta WHERE key = 'store_id';");
    migrated = had_id.ok() && had_id.Step() != SQLITE_ROW;
  }  // finalized: no read transaction left open
  if (absl::Status s = store->LoadOrCreateStoreId(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("job store ", path, ": store id: ", s.message()));
  }
  if (!exists) {
    spdlog::info("job store {}: created (store id {})", path, store->store_id_);
  } else if (initialized) {
    spdlog::warn("job store {}: it was empty; initialized as a new job store (store id {}) as --init-store asked",
                 path, store->store_id_);
  } else if (migrated) {
    spdlog::info("job store {}: written before store ids; its store id is now {}", path, store->store_id_);
  }
  return store;
}

absl::Status JobStore::LoadOrCreateStoreId() {
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      Statement select(db_, "SELECT value FROM meta WHERE key = 'store_id';");
      if (!select.ok()) return Error("prepare select store id");
      if (select.Step() == SQLITE_ROW) {
        store_id_ = select.ColumnBytes(0);
        return absl::OkStatus();
      }
    }
    // INSERT OR IGNORE: of two processes opening an old store at once, the first id stays.
    Statement insert(db_, "INSERT OR IGNORE INTO meta (key, value) VALUES ('store_id', ?);");
    if (!insert.ok()) return Error("prepare insert store id");
    insert.BindText(1, NewStoreId());
    if (insert.Step() != SQLITE_DONE) return Error("insert store id");
  }
  return absl::InternalError("no store id after writing one");
}

JobStore::~JobStore() {
  absl::MutexLock lock(&mu_);
  sqlite3_close(db_);
}

absl::Status JobStore::Exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown error";
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat("sqlite: ", msg));
  }
  return absl::OkStatus();
}

absl::Status JobStore::Error(const char* what) {
  return absl::InternalError(absl::StrCat("sqlite ", what, ": ", sqlite3_errmsg(db_)));
}

absl::StatusOr<int64_t> JobStore::InsertJob(const v1::Job& job, const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  if (auto s = Exec("BEGIN IMMEDIATE;"); !s.ok()) return s;
  auto rollback = [this](absl::Status s) {
    mu_.AssertHeld();
    (void)Exec("ROLLBACK;");
    return s;
  };
  Statement insert(db_, "INSERT INTO jobs (state, priority, job) VALUES (?, ?, ?);");
  if (!insert.ok()) return rollback(Error("prepare insert job"));
  insert.BindInt(1, job.state());
  insert.BindInt(2, job.spec().priority());
  insert.BindBlob(3, job.SerializeAsString());
  if (insert.Step() != SQLITE_DONE) return rollback(Error("insert job"));
  const int64_t id = sqlite3_last_insert_rowid(db_);
  if (!request_id.empty()) {
    Statement rid(db_, "INSERT INTO tenant_request_ids (tenant, request_id, job_id) VALUES (?, ?, ?);");
    if (!rid.ok()) return rollback(Error("prepare insert request id"));
    rid.BindText(1, job.tenant());
    rid.BindText(2, request_id);
    rid.BindInt(3, id);
    if (rid.Step() != SQLITE_DONE) return rollback(Error("insert request id"));
  }
  if (auto s = Exec("COMMIT;"); !s.ok()) return rollback(s);
  return id;
}

absl::Status JobStore::UpdateJob(int64_t id, const v1::Job& job) {
  absl::MutexLock lock(&mu_);
  Statement update(db_, "UPDATE jobs SET state = ?, priority = ?, job = ? WHERE id = ?;");
  if (!update.ok()) return Error("prepare update job");
  update.BindInt(1, job.state());
  update.BindInt(2, job.spec().priority());
  update.BindBlob(3, job.SerializeAsString());
  update.BindInt(4, id);
  if (update.Step() != SQLITE_DONE) return Error("update job");
  if (sqlite3_changes(db_) != 1) return absl::NotFoundError(absl::StrCat("job ", id, " is not in the store"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<int64_t, v1::Job>>> JobStore::LoadJobs() {
  absl::MutexLock lock(&mu_);
  Statement select(db_, "SELECT id, job FROM jobs ORDER BY id;");
  if (!select.ok()) return Error("prepare select jobs");
  std::vector<std::pair<int64_t, v1::Job>> jobs;
  int rc;
  while ((rc = select.Step()) == SQLITE_ROW) {
    v1::Job job;
    if (!job.ParseFromString(select.ColumnBytes(1))) {
      return absl::DataLossError(absl::StrCat("job ", select.ColumnInt(0), " in the store does not parse"));
    }
    jobs.emplace_back(select.ColumnInt(0), std::move(job));
  }
  if (rc != SQLITE_DONE) return Error("select jobs");
  return jobs;
}

absl::StatusOr<std::vector<JobStore::RequestId>> JobStore::LoadRequestIds() {
  absl::MutexLock lock(&mu_);
  Statement select(db_, "SELECT tenant, request_id, job_id FROM tenant_request_ids;");
  if (!select.ok()) return Error("prepare select request ids");
  std::vector<RequestId> out;
  int rc;
  while ((rc = select.Step()) == SQLITE_ROW) {
    out.push_back({select.ColumnBytes(0), select.ColumnBytes(1), select.ColumnInt(2)});
  }
  if (rc != SQLITE_DONE) return Error("select request ids");
  return out;
}

absl::Status JobStore::AppendEvent(int64_t job_id, const v1::JobEvent& event) {
  absl::MutexLock lock(&mu_);
  Statement insert(db_, "INSERT INTO events (job_id, event) VALUES (?, ?);");
  if (!insert.ok()) return Error("prepare insert event");
  insert.BindInt(1, job_id);
  insert.BindBlob(2, event.SerializeAsString());
  if (insert.Step() != SQLITE_DONE) return Error("insert event");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<int64_t, v1::JobEvent>>> JobStore::LoadEventPage(int64_t job_id,
                                                                                       int64_t after_seq,
                                                                                       int64_t limit) {
  absl::MutexLock lock(&mu_);
  Statement select(db_, "SELECT seq, event FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?;");
  if (!select.ok()) return Error("prepare select event page");
  select.BindInt(1, job_id);
  select.BindInt(2, after_seq);
  select.BindInt(3, limit);
  std::vector<std::pair<int64_t, v1::JobEvent>> events;
  int rc;
  while ((rc = select.Step()) == SQLITE_ROW) {
    v1::JobEvent event;
    if (!event.ParseFromString(select.ColumnBytes(1))) return absl::DataLossError("event does not parse");
    events.emplace_back(select.ColumnInt(0), std::move(event));
  }
  if (rc != SQLITE_DONE) return Error("select event page");
  return events;
}

absl::Status JobStore::AddCheckpoint(int64_t job_id, int64_t step, const std::string& directory) {
  absl::MutexLock lock(&mu_);
  Statement insert(db_, "INSERT OR REPLACE INTO checkpoints (job_id, step, directory) VALUES (?, ?, ?);");
  if (!insert.ok()) return Error("prepare insert checkpoint");
  insert.BindInt(1, job_id);
  insert.BindInt(2, step);
  insert.BindText(3, directory);
  if (insert.Step() != SQLITE_DONE) return Error("insert checkpoint");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> JobStore::LoadCheckpoints(int64_t job_id) {
  absl::MutexLock lock(&mu_);
  Statement select(db_, "SELECT step, directory FROM checkpoints WHERE job_id = ? ORDER BY step;");
  if (!select.ok()) return Error("prepare select checkpoints");
  select.BindInt(1, job_id);
  std::vector<std::pair<int64_t, std::string>> out;
  int rc;
  while ((rc = select.Step()) == SQLITE_ROW) out.emplace_back(select.ColumnInt(0), select.ColumnBytes(1));
  if (rc != SQLITE_DONE) return Error("select checkpoints");
  return out;
}

}  // namespace odyssey::server
