// JobStore: the controller's durable state in one SQLite database (WAL mode).
//
// Tables: jobs (the Job message, its state and priority), events (each JobEvent of a job, in
// order), checkpoints (directories written, by job and step) and tenant_request_ids (CreateJob
// idempotency keys, unique per tenant -> job id; a store written before tenants existed has
// its `request_ids` moved there, as the anonymous tenant's, when opened). The controller keeps its working set in memory and writes
// through to the store, so after a restart (even after kill -9) LoadJobs() returns every job
// as last written. Writes are durable when they return (synchronous=NORMAL in WAL mode: a
// power loss may drop the last transactions, a process crash does not).
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
  // Opens (creating when missing) the database at `path`; its folder must exist.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path);
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
  absl::StatusOr<std::vector<odyssey::v1::JobEvent>> LoadEvents(int64_t job_id);
  absl::Status AddCheckpoint(int64_t job_id, int64_t step, const std::string& directory);
  // (step, directory) of every checkpoint of a job, by ascending step.
  absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> LoadCheckpoints(int64_t job_id);

 private:
  explicit JobStore(sqlite3* db) : db_(db) {}
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Error(const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_);
};

}  // namespace odyssey::server
