// Worker: the odyssey-worker daemon's core. Keeps one WorkerService.Attach stream open to the
// controller and runs the jobs it is assigned, one at a time (a worker is one device).
//
// Protocol (the controller's reading is in server/controller.h):
//   - Every Attach starts with `hello` (WorkerCapabilities), then `held`: the jobs this worker
//     still holds — the one running and any that ended but whose result the controller has not
//     released yet — followed by the unreleased results themselves (a result is re-sent on every
//     new stream until the controller answers `release`).
//   - `assign` starts a JobRunner; `cancel` stops it before its next step (its result carries
//     `cancelled`); `release` forgets an ended job.
//   - Heartbeats every heartbeat_interval; progress as the runner reports it (dropped while
//     disconnected: only the newest matters, and the result carries the final state).
//   - When the stream breaks (controller gone, network), running jobs keep running and the
//     worker reconnects with exponential backoff (initial_backoff doubling to max_backoff).
//   - Security (server/README.md, "Auth and TLS"): with `tls.ca` the channel is TLS trusting
//     only that CA; with `token_file` every Attach carries `authorization: Bearer <token>` (a
//     token of the controller's reserved tenant @worker). Both files are read again on every
//     (re)connect, so rotated certificates and tokens are picked up without a restart; a
//     refused Attach (UNAUTHENTICATED, PERMISSION_DENIED) is logged and retried with backoff.
// Thread safety: Run() blocks the calling thread until Shutdown() (callable from any thread,
// e.g. a signal handler thread). Internal state is guarded by mu_.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/tls.h"
#include "odyssey/v1/odyssey.pb.h"
#include "worker/job_runner.h"

namespace grpc {
class Status;
}  // namespace grpc

namespace odyssey::worker {

class WorkerMetrics;

struct WorkerOptions {
  std::string controller;   // host:port of the controller's gRPC server
  ClientTlsOptions tls;     // empty ca = plaintext
  std::string token_file;   // bearer token file (see common/tls.h ReadTokenFile); empty = none
  odyssey::v1::WorkerCapabilities capabilities;  // worker_id must be set
  JobRunnerOptions runner;
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  int max_message_bytes = 64 << 20;
};

// The cancel reason of a run stopped by Worker::Shutdown; its JobResult carries worker_leaving.
inline constexpr char kLeavingReason[] = "the worker is shutting down";

class Worker {
 public:
  // `metrics` may be null; it must outlive the worker.
  Worker(WorkerOptions options, WorkerMetrics* metrics);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Attaches and serves until Shutdown(). Returns OK after a shutdown.
  absl::Status Run();
  // Stops: cancels the running job between steps (it reports its result, marked
  // worker_leaving, if still attached: the controller restarts the job elsewhere) and makes Run()
  // return once the stream is closed.
  void Shutdown();

 private:
  // Handles one message from the controller.
  void Handle(const odyssey::v1::ControllerMessage& message);
  // Queues a message for the current stream; dropped when there is none (progress only:
  // results go through OnResult, which keeps them until released).
  void Post(odyssey::v1::WorkerMessage message) ABSL_LOCKS_EXCLUDED(mu_);
  void OnResult(const odyssey::v1::JobResult& result) ABSL_LOCKS_EXCLUDED(mu_);
  // One stream's lifetime: hello, held, resend results, then pump the outbox until it breaks.
  // Returns true if the stream got as far as the controller's first answer or ran a while.
  bool Serve();
  // Logs an Attach refused for its credentials (UNAUTHENTICATED, PERMISSION_DENIED); false
  // (nothing logged) for any other status.
  bool LogRefusal(const std::string& id, const grpc::Status& status) const;

  const WorkerOptions options_;
  WorkerMetrics* const metrics_;

  absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  bool stream_broken_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<odyssey::v1::WorkerMessage> outbox_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<JobRunner> runner_ ABSL_GUARDED_BY(mu_);       // the current or last run
  std::string running_job_ ABSL_GUARDED_BY(mu_);  // set from assign until its result is in
  std::map<std::string, odyssey::v1::JobResult> unreleased_ ABSL_GUARDED_BY(mu_);  // by job
  std::vector<std::unique_ptr<JobRunner>> finished_runners_ ABSL_GUARDED_BY(mu_);  // to join
};

}  // namespace odyssey::worker
