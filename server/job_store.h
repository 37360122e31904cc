// JobStore: the controller's durable state in one SQLite database (WAL mode).
//
// Tables: meta (the store's identity: store_id, a random 128-bit hex string written when the
// store is created), jobs (the Job message, its state and priority), events (each JobEvent of a job, in
// order), checkpoints (directories written, by job and step) and tenant_request_ids (CreateJob
// idempotency keys, unique per tenant -> job id; a store written before tenants existed has
// its `request_ids` moved there, as the anonymous tenant's, when opened). The controller keeps its working set in memory and writes
// through to the store, so after a restart (even after kill -9) LoadJobs() returns every job
// as last written. Writes are durable when they return (synchronous=NORMAL in WAL mode: a
// power loss may drop the last transactions, a process crash does not).
//
// Identity: job ids restart at 1 in a new store, so "jobs/1" alone does not name one run across
// stores. store_id() + the job name does: it is what a job's checkpoint folders are owned by
// (Assignment.checkpoint_owner). Open() never starts over silently: a file that exists but is not
// an odyssey job store (0 bytes, not SQLite, SQLite without odyssey's tables) is refused naming
// it, and only a file that holds nothing (0 bytes, or a SQLite database without tables) is
// initialized, and only when asked (`initialize`: odyssey-controller --init-store). A file with
// content that is not odyssey's is never overwritten or added to, even when asked.
//
// Thread safety: all methods may be called from any thread; one connection under a mutex.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "odyssey/v1/odyssey.pb.h"

namespace odyssey::server {

class JobStore {
 public:
  // Opens the job store at `path`; its folder must exist. A missing file is created (a first
  // run: a new store_id). An existing file must be an odyssey job store (a `jobs` table with
  // odyssey's columns; one written before store ids existed gets its store_id now); else
  // FAILED_PRECONDITION naming the file and what it holds, except that with `initialize` an
  // empty file (0 bytes, or SQLite without tables) becomes a new store (logged as a warning).
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path, bool initialize = false);
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Inserts `job` (its name is ignored) and, when request_id is non-empty, the
  // (job.tenant(), request_id) -> id row, in one transaction. Returns the new id. A request id
  // the same tenant already used is an error (the controller checks first).
  absl::StatusOr<int64_t> InsertJob(const odyssey::v1::Job& job, const std::string& request_id);
  // Overwrites job `id` (state and priority columns follow the message).
  absl::Status UpdateJob(int64_t id, const odyssey::v1::Job& job);
  // Every job, by ascending id.
  absl::StatusOr<std::vector<std::pair<int64_t, odyssey::v1::Job>>> LoadJobs();
  struct RequestId {
    std::string tenant;
    std::string request_id;
    int64_t job_id = 0;
  };
  // Every (tenant, request id) -> job id.
  absl::StatusOr<std::vector<RequestId>> LoadRequestIds();

  absl::Status AppendEvent(int64_t job_id, const odyssey::v1::JobEvent& event);
  // At most `limit` events of a job recorded after the event numbered `after_seq` (0 = from the
  // first), oldest first, each with its number (events of all jobs share one ascending sequence).
  absl::StatusOr<std::vector<std::pair<int64_t, odyssey::v1::JobEvent>>> LoadEventPage(int64_t job_id,
                                                                                        int64_t after_seq,
                                                                                        int64_t limit);
  absl::Status AddCheckpoint(int64_t job_id, int64_t step, const std::string& directory);
  // (step, directory) of every checkpoint of a job, by ascending step.
  absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> LoadCheckpoints(int64_t job_id);

  // The store's identity: 32 lowercase hex digits, fixed when the store was created. Never
  // changes after Open (no lock needed).
  const std::string& store_id() const { return store_id_; }

 private:
  explicit JobStore(sqlite3* db) : db_(db) {}
  // Reads the store id from `meta`, writing a new one when there is none.
  absl::Status LoadOrCreateStoreId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Error(const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_);
  std::string store_id_;  // set once by Open
};

}  // namespace odyssey::server
