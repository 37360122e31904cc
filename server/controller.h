// Controller: the core of odyssey-controller. Owns jobs (durable in a JobStore), the worker
// registry and the gang scheduler, and applies the restart policy. Knows nothing of gRPC:
// the service layer (service.h) validates requests, calls these methods and converts the
// absl::Status once at the edge; workers are reached through the WorkerConnection interface.
//
// The class holds the state (jobs, workers, the store, the one mutex) and the API; each concern
// lives in its own file (as tensorflow/serving's ServerCore hands each API to its own unit):
// - controller.cc: construction, persistence (Commit, SetState), JobService (CreateJob ...
//   WatchJob), paths, and Schedule/Assign, which apply the gang scheduler's decision.
// - workers.cc: the worker registry (WorkerService: attach, messages, detach), liveness (Tick)
//   and what losing a rank does to its job (restart or fail).
// - planning.cc: the planner's verdicts (CheckFits for CreateJob, PlannerService.Plan).
// - session_router.cc: the TrainingService (Train): pending calls, sequences, routing to the
//   workers' streams, replies.
// - Units of plain data with their own tests: scheduler.h (which PENDING jobs start on which idle
//   workers), rl_batch.h (a multi-rank call's split and merge), controller_metrics.h (the
//   Prometheus families).
//
// Worker protocol, as the controller reads it (see server/README.md):
// - A worker attaches with its capabilities, then sends `held` (the jobs it still runs; empty
//   on a fresh start), heartbeats, progress and results. Any message counts as liveness.
// - A worker's states (workers.cc): returning (attached, its `held` not read yet), idle, busy
//   (bound to one job, from assignment until it reports a JobResult for it, also after a
//   cancel), stopping (it came back still running jobs the controller no longer wants: each
//   got `cancel`; busy until each one's JobResult), disconnected (no stream) and dead (erased).
//   Only an idle worker gets assignments. On re-attach `held` reconciles: a job the
//   controller still runs on this worker continues, any other held job is told to stop.
// - A worker_id attached on a live stream is refused (ALREADY_EXISTS) until that stream ends
//   or is declared dead; it never replaces the stream (a second process with the same id
//   would take over the first one's job).
// - A worker whose stream ends or that is silent for heartbeat_timeout is disconnected; a
//   disconnected worker that does not re-attach within heartbeat_timeout is dead: its job is
//   put back in the queue (resume_from = last checkpoint, restarts + 1) while
//   restarts < restart_limit, else FAILED. Other ranks of that job get `cancel`.
// - Gang scheduling (scheduler.h): the first queued job (highest priority, then oldest) that
//   needs W workers starts only when W idle workers exist (one host preferred); jobs behind it
//   wait (strict FIFO within priority, no partial starts, no backfill).
// - After a controller restart, RUNNING jobs keep their workers for heartbeat_timeout: the
//   workers re-attach and report `held`, or the job is restarted as above.
// - Paths (options.paths on): a job about to start (or restart) whose spec the path policy
//   refuses (it was stored under another configuration) fails instead, and the scheduler
//   moves on to the next job.
//
// TrainingService (RL_SESSION jobs; Train() below, server/README.md "TrainingService"):
// - A call is forwarded to the job's worker as a TrainingCall with a fresh call_id (ids
//   start at the controller's start time in microseconds, so a reply meant for an earlier
//   controller process never matches) and answered by the worker's TrainingReply. Calls are
//   handed to the worker's stream in the order they take the mutex; the worker runs them FIFO,
//   one at a time. So calls of one job execute in the order the controller received them.
// - A session of N > 1 ranks (data parallel): forward_backward and forward are split into N
//   contiguous datum ranges balanced by token count (rl_batch.h SplitBatch), each rank getting
//   its slice, the slice's whole-batch datum offset and, for forward_backward, W of the whole
//   batch; optim_step and load_checkpoint go to every rank; save_checkpoint and export_weights
//   to rank 0 only (the ranks' weights are identical). The messages of one call reach every
//   rank's stream in one mutex section, so all ranks' FIFOs hold the calls in the same order
//   (the engine's collectives pair them up by order). The replies are merged into one
//   (rl_batch.h MergeReplies).
// - sequence > 0: call n of a job is forwarded only after call n-1 was; a call whose
//   predecessor does not arrive within sequence_wait gets ABORTED; a sequence already received
//   (or already waiting) gets ALREADY_EXISTS.
// - Pending calls never hang: the worker's stream ending fails them with UNAVAILABLE, the job
//   leaving RUNNING (cancel, worker loss, end) with ABORTED.
// - A session's idle timeout is the worker's (worker/README.md): it ends the run with an ok
//   result, which makes the job SUCCEEDED here.
//
// Thread safety: all public methods may be called from any thread (one mutex). Messages to
// workers are handed to WorkerConnection::Send under that mutex, so Send must not block.
// Train() waits for its reply (and a sequenced call for its turn) with the mutex released.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "odyssey/v1/odyssey.pb.h"
#include "planner/planner.h"
#include "prometheus/registry.h"
#include "server/controller_metrics.h"
#include "server/job_store.h"
#include "server/paths.h"

namespace odyssey::server {

// The controller's end of one worker's Attach stream.
class WorkerConnection {
 public:
  virtual ~WorkerConnection() = default;
  // Queues a message to the worker. Must not block (called under the controller's mutex).
  virtual void Send(const odyssey::v1::ControllerMessage& message) = 0;
  // Ends the stream (a newer Attach of the same worker replaced it, or it was declared dead).
  virtual void Close() = 0;
};

// A bounded-wait queue of one WatchJob stream's events.
class JobWatch {
 public:
  // Waits up to `timeout` for the next event. Returns it, or nullopt on timeout or when the
  // watch is over (then done() is true: the job ended and every event was delivered).
  std::optional<odyssey::v1::JobEvent> Next(absl::Duration timeout);
  bool done() const;

  // Producer side (the controller).
  void Push(odyssey::v1::JobEvent event);
  void Finish();

 private:
  mutable absl::Mutex mu_;
  std::deque<odyssey::v1::JobEvent> events_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// How often a job's attempt is run again, on another port, after its ranks did not meet
// (JobResult.rendezvous_failed) before the job FAILS; such retries are not restarts.
inline constexpr int kRendezvousRetryLimit = 3;

// The port rank 0 of job `id` listens on for its ranks at attempt `attempt` (0 first, then one
// more per restart or rendezvous retry), in the window of W = min(10000, 65536 - base) ports from
// base: base + id % W first; each later attempt moves it by a stride coprime with W (4999 for
// 10000), so a port still held (by a stopped rank 0 of an earlier attempt, or another process)
// is not asked for again until W attempts later, and no port passes 65535.
// REQUIRES: 1 <= base <= 65535 (the controller's flag is checked).
int RendezvousPort(int base, int64_t id, int64_t attempt);

struct ControllerOptions {
  // A worker silent this long is disconnected; disconnected this long, dead.
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  // Default checkpoint folder root: a job without checkpoint.directory writes to
  // <checkpoint_root>/job-<id> (when `paths` is off; see DefaultCheckpointDir).
  std::string checkpoint_root = "odyssey-state/checkpoints";
  // Which paths clients may name (server/paths.h); default: off, any absolute path.
  PathPolicy paths;
  // Rank 0 of job <id> hosts its rendezvous at <rank 0 host>:<RendezvousPort(base, id, attempt)>: base +
  // id % 10000 on its first attempt, another port of [base, min(base + 10000, 65536)) on each
  // later one. In [1, 65535].
  int rendezvous_port_base = 29500;
  // The time source (tests pass a fake clock).
  std::function<absl::Time()> clock = [] { return absl::Now(); };
  // Where metrics go; null = none.
  std::shared_ptr<prometheus::Registry> registry;
  // How long a sequenced TrainingService call waits for its predecessor (real time) before it
  // gets ABORTED.
  absl::Duration sequence_wait = absl::Seconds(30);
};

// What the registry holds about a worker (for tests and status).
struct WorkerInfo {
  std::string id;
  bool connected = false;
  std::string job;  // "jobs/{id}" when busy
  // "returning", "idle", "busy", "stopping" (told to stop jobs it came back with), "leaving" (it is
  // shutting down), "disconnected".
  std::string state;
};

class Controller {
 public:
  // Loads every job from `store`. REQUIRES: store != nullptr.
  static absl::StatusOr<std::unique_ptr<Controller>> Create(ControllerOptions options,
                                                            std::unique_ptr<JobStore> store);
  ~Controller();
  Controller(const Controller&) = delete;
  Controller& operator=(const Controller&) = delete;

  // JobService. REQUIRES: the request passed validation.h's checks.
  //
  // Tenants (see server/auth.h): `tenant` is the caller's, as the service layer got it from
  // CallerTenant (kAnonymousTenant "" when auth is off). A job belongs to the tenant that
  // created it (Job.tenant, persisted); ListJobs shows only the caller's jobs, and
  // GetJob/CancelJob/WatchJob/CheckJobAccess on another tenant's job are PERMISSION_DENIED
  // "name: jobs/N belongs to another tenant". (PERMISSION_DENIED rather than NOT_FOUND: job ids
  // are one global sequence, so a job's existence tells nothing that a tenant cannot infer from
  // its own ids, and the clearer error saves operators from hunting a job that is there.)
  // Request ids are scoped per tenant: two tenants may use the same one.
  absl::StatusOr<odyssey::v1::Job> CreateJob(const odyssey::v1::CreateJobRequest& request, const std::string& tenant);
  absl::StatusOr<odyssey::v1::Job> GetJob(int64_t id, const std::string& tenant);
  absl::StatusOr<odyssey::v1::ListJobsResponse> ListJobs(const odyssey::v1::ListJobsRequest& request,
                                                         const std::string& tenant);
  // PENDING or RUNNING -> CANCELLED (the workers get `cancel`); CANCELLED stays CANCELLED;
  // SUCCEEDED and FAILED -> FAILED_PRECONDITION.
  absl::StatusOr<odyssey::v1::Job> CancelJob(int64_t id, const std::string& tenant);
  // Events of job `id`: its current state (and latest step metrics) first, then every event
  // until the job ends.
  absl::StatusOr<std::shared_ptr<JobWatch>> WatchJob(int64_t id, const std::string& tenant);
  // The events recorded for job `id`, oldest first, one page (the store's, so a restarted
  // controller still has them). REQUIRES: the request passed ValidateListJobEventsRequest.
  absl::StatusOr<odyssey::v1::ListJobEventsResponse> ListJobEvents(int64_t id,
                                                                   const odyssey::v1::ListJobEventsRequest& request,
                                                                   const std::string& tenant);
  // OK when job `id` exists and belongs to `tenant`; else NOT_FOUND or PERMISSION_DENIED with
  // the messages above, which start with `field` (the request field naming the job: "job" in
  // the TrainingService). For handlers that act on a job by name and must check the caller's
  // right to it before anything else.
  absl::Status CheckJobAccess(int64_t id, const std::string& tenant, absl::string_view field = "name");

  // Path confinement (server/paths.h, options.paths). OK when `tenant` may name the paths of
  // `spec` (validation.h CheckJobSpecPaths) and, when spec.checkpoint.directory is empty, the
  // tenant's default checkpoint folder still resolves inside its tenant folder (a symbolic link
  // there must not steer the workers' writes); else PERMISSION_DENIED / INVALID_ARGUMENT naming
  // the field. The service calls it before validation.h's checks, which read model and dataset
  // files; CreateJob calls it again.
  absl::Status CheckPaths(const odyssey::v1::JobSpec& spec, const std::string& tenant) const;
  // The same for the directory of a TrainingService call (CheckTrainingCallPaths).
  absl::Status CheckPaths(const odyssey::v1::TrainingCall& call, const std::string& tenant) const;
  // Where job `id` of `tenant` writes checkpoints when its spec names no folder: with paths on,
  // <tenant folder>/checkpoints/job-<id> (so the tenant may load them back); else
  // <checkpoint_root>/job-<id>.
  std::string DefaultCheckpointDir(int64_t id, const std::string& tenant) const;
  // Checkpoint folders (worker/README.md "Checkpoint folders"): a folder serves one live job at
  // a time. CreateJob refuses a spec.checkpoint.directory that a PENDING or RUNNING job writes to
  // (its own directory or its default folder; normalized absolute paths) with
  // FAILED_PRECONDITION naming the folder and the job (another tenant's job is not named). The
  // workers enforce the rest: a job's step folders carry its owner, "<store id>/jobs/N"
  // (Assignment.checkpoint_owner), and a job does not start in a folder holding another's.

  // WorkerService. Returns the attach session id to pass back to the calls below.
  absl::StatusOr<int64_t> AttachWorker(const odyssey::v1::WorkerCapabilities& capabilities,
                                       const std::string& peer_host,
                                       std::shared_ptr<WorkerConnection> connection);
  // Handles a message of a worker's stream. Messages of a replaced session are ignored.
  void OnWorkerMessage(int64_t session, const odyssey::v1::WorkerMessage& message);
  // The worker's stream ended.
  void DetachWorker(int64_t session);

  // TrainingService. Forwards `call` (one of its `call` oneof set; call_id and job are filled
  // in here) to the worker running RL_SESSION job `id` and waits for the reply. `sequence` is
  // the request's (0 = unordered). `cancelled` (may be null) is polled about once a second
  // while waiting: when it returns true (the client went away) the wait ends with CANCELLED
  // (the call may still run on the worker). Returns the reply when its code is OK, else its
  // status unchanged (the engine's INVALID_ARGUMENT messages reach the client as written).
  // N ranks: the reply merges the ranks' (logprobs concatenated in datum order, loss summed,
  // weight_sum = W of the whole batch, mismatch token-weighted, counts summed, seconds the
  // slowest rank's; other calls: rank 0's reply); when a rank fails, the most specific error
  // (not the engine's "... on another rank" echoes; else the first in rank order).
  // Errors of its own: NOT_FOUND (no such job), FAILED_PRECONDITION (not an RL_SESSION, or not
  // RUNNING: the message names the kind/state), INVALID_ARGUMENT (`batch` holds more token
  // positions than the session's data.seq_len x data.batch_size per rank: the whole batch
  // more than N times that, or one rank's slice more than that), ALREADY_EXISTS / ABORTED
  // (sequence, see above), UNAVAILABLE / ABORTED (a worker of the session went away, the job
  // ended).
  // REQUIRES: the request passed validation.h's checks.
  absl::StatusOr<odyssey::v1::TrainingReply> Train(int64_t id, odyssey::v1::TrainingCall call, int64_t sequence,
                                                   const std::function<bool()>& cancelled = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Answers a TrainingService call of job `id` that the edge refused (`refusal`: its request
  // broke a validation rule) in its turn: a sequenced call of a RUNNING session first waits
  // for its predecessor like any call (AwaitSequence), so its number is used up and the calls
  // after it are not held back by a gap. Returns `refusal` (or the sequence's own error) and
  // counts it. REQUIRES: the caller may access job `id` (CheckJobAccess).
  absl::Status RefuseInTurn(int64_t id, int64_t sequence, const std::string& method, const absl::Status& refusal,
                            const std::function<bool()>& cancelled = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts a TrainingService call that ended before Train (e.g. rejected by validation) in
  // odyssey_training_calls_total{method, code}.
  void CountTrainingCall(const std::string& method, absl::StatusCode code);

  // Liveness checks and scheduling; call periodically (the binary: every 100 ms).
  void Tick();

  // PlannerService.Plan: the planner's answer for `request.spec` (REQUIRES: validated, paths
  // checked) on the hardware CreateJob's check would use, or the request's: the strategy (the
  // spec's memory fields over the planner's choice, as a worker applies them), its predicted
  // peaks term by term, and with max_seq_len the longest length that fits. Never an error for
  // a spec that does not fit: fits = false and the message say by how much (the strategy is then
  // the least-bad one). CreateJob accepts exactly the specs this says fit (server/admission_test).
  absl::StatusOr<odyssey::v1::PlanResponse> Plan(const odyssey::v1::PlanRequest& request);

  std::vector<WorkerInfo> Workers();
  // Sequenced TrainingService calls of job `id` waiting for their turn (for tests and status).
  int WaitingCalls(int64_t id);

 private:
  struct Worker {
    std::string id;
    odyssey::v1::WorkerCapabilities capabilities;
    std::string host;
    int64_t session = 0;  // current stream; 0 = disconnected
    std::shared_ptr<WorkerConnection> connection;
    absl::Time last_seen;           // last message (connected)
    absl::Time disconnected_since;  // when the stream ended (disconnected)
    int64_t job = 0;                // bound job id; 0 = idle
    // The job bound when the current stream attached: the first `held` must list it, else it
    // is lost. (Jobs assigned after the attach may be missing from that `held`, which the
    // worker wrote before it saw them.)
    int64_t job_at_attach = 0;
    // Returning: attached, its `held` not read yet. Nothing is assigned to it until then (it
    // may still run a job the controller gave up on while it was silent).
    bool awaiting_held = false;
    // Jobs it still runs that the controller told it to stop (it came back holding a job that
    // was restarted elsewhere, cancelled or ended): busy until each one's JobResult arrives.
    std::set<int64_t> stopping;
    absl::Time attached_at;
    // It said it is shutting down (a JobResult with worker_leaving): nothing more is assigned to
    // it until it attaches again (a restarted process).
    bool leaving = false;
    // Idle: attached, held read, bound to no job, stopping nothing, not leaving.
    bool Idle() const { return session != 0 && !awaiting_held && job == 0 && stopping.empty() && !leaving; }
  };
  // A TrainingCall forwarded to a worker, waiting for its reply.
  struct PendingCall {
    int64_t job = 0;
    std::string worker;
    // One rank's part of a multi-rank call: the reply's effects on the job (metrics, the last
    // checkpoint) wait for the merged reply (Train applies them).
    bool part = false;
    bool done = false;
    absl::Status status;  // not OK: failed without a reply (worker gone, job ended)
    odyssey::v1::TrainingReply reply;
  };
  // Ordering state of one RL session's sequenced calls.
  struct SequenceState {
    int64_t next = 1;          // the sequence forwarded next
    std::set<int64_t> waiting;  // sequences waiting for their turn
  };

  Controller(ControllerOptions options, std::unique_ptr<JobStore> store);

  // controller.cc: jobs, persistence, scheduling.
  odyssey::v1::Job* FindJob(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Job `id` when it exists and belongs to `tenant`; else NOT_FOUND / PERMISSION_DENIED.
  absl::StatusOr<odyssey::v1::Job*> FindTenantJob(int64_t id, const std::string& tenant,
                                                  absl::string_view field = "name")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Persists job `id` and records `event` (stamped with the job name and now).
  void Commit(int64_t id, std::optional<odyssey::v1::JobEvent> event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetState(int64_t id, odyssey::v1::Job::State state, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendTo(const std::string& worker_id, const odyssey::v1::ControllerMessage& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends `cancel` to every worker of job `id` other than `except`.
  void CancelRanks(int64_t id, const std::string& except) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts what the gang scheduler (scheduler.h) picks from the PENDING jobs and idle workers;
  // fails the jobs the path policy now refuses.
  void Schedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Assign(int64_t id, const std::vector<std::string>& worker_ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where job `id` writes checkpoints: its spec's directory, else its default folder.
  std::string CheckpointDirOf(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "<store id>/jobs/N": who job `id`'s step folders belong to, unique across job stores.
  std::string CheckpointOwner(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION when a PENDING or RUNNING job writes checkpoints to `spec`'s
  // checkpoint.directory (see CheckpointDirOf); OK for an empty one (a new job's default folder
  // is its own).
  absl::Status CheckFolderFree(const odyssey::v1::JobSpec& spec, const std::string& tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets the jobs-by-state and workers-by-state gauges from jobs_ and workers_.
  void UpdateGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // workers.cc: the worker registry.
  Worker* WorkerBySession(int64_t session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnProgress(Worker& worker, const odyssey::v1::JobProgress& progress) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnResult(Worker& worker, const odyssey::v1::JobResult& result) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnHeld(Worker& worker, const odyssey::v1::HeldJobs& held) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Job `id` wrote a checkpoint: its last_checkpoint (what a restart resumes from), a store row,
  // a `checkpoint` event; once per (step, directory).
  void RecordCheckpoint(int64_t id, int64_t step, const std::string& directory) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank of job `id` is gone: restart it (from its last checkpoint) or fail it.
  void RankLost(int64_t id, const std::string& worker_id, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WorkerDead(const std::string& worker_id, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // planning.cc.
  // CreateJob's admission: the one planning rule (planner::PlanJobSpec, as Plan applies it) for
  // one rank of `spec` on MachineToPlanFor(); FAILED_PRECONDITION saying by how much when it
  // does not fit, INVALID_ARGUMENT when the memory fields cannot run on the model. With only
  // CPU workers attached, by their host memory (MachineToPlanFor).
  absl::Status CheckFits(const odyssey::v1::JobSpec& spec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The machine one rank is planned for: the largest GPU among the attached workers, with that
  // worker's host memory (raw sizes; PlanHardware applies planner::MachineHardware's rule);
  // with only CPU workers attached, the one with the most host memory (a CPU rank computes in
  // host memory: planner::CpuHardware); an H200 host when no worker is attached. `source` says
  // which.
  struct PlanMachine {
    int64_t device_memory_bytes = 0, host_memory_bytes = 0;  // 0: an H200 host (planner::Hardware{})
    bool any_worker = false, gpu_worker = false;
    bool cpu = false;  // only CPU workers: host_memory_bytes is the largest one's
    std::string source;
  };
  PlanMachine MachineToPlanFor() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The planner's hardware for `machine` under the job's host budget (> 0 wins).
  static planner::Hardware PlanHardware(const PlanMachine& machine, int64_t spec_host_budget_bytes);

  // session_router.cc: the TrainingService.
  void OnReply(Worker& worker, const odyssey::v1::TrainingReply& reply) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a successful reply of job `id` changes on the controller: mismatch and step gauges, the
  // last checkpoint (what a restart resumes from).
  void ApplyReply(int64_t id, const odyssey::v1::TrainingReply& reply) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Train() for a session of job.workers_size() > 1 ranks, after the sequence took its turn:
  // splits, forwards to the ranks, waits for every reply and merges them (see Train).
  absl::StatusOr<odyssey::v1::TrainingReply> TrainRanks(int64_t id, odyssey::v1::TrainingCall call, int64_t sequence,
                                                        const std::function<bool()>& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the pending calls of job `id` (all jobs when 0) that went to `worker_id` (any worker
  // when empty) with `status`.
  void FailPendingCalls(int64_t id, const std::string& worker_id, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (mu_ released) for a sequenced call's turn. OK when it is its turn.
  absl::Status AwaitSequence(int64_t id, int64_t sequence, const std::function<bool()>& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION unless job `id` (which exists) is a RUNNING RL_SESSION.
  absl::Status CheckServesTraining(const odyssey::v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ControllerOptions options_;
  ControllerMetrics metrics_;  // no-ops without options_.registry

  absl::Mutex mu_;
  std::unique_ptr<JobStore> store_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, odyssey::v1::Job> jobs_ ABSL_GUARDED_BY(mu_);
  // (tenant, request_id) -> job id.
  absl::flat_hash_map<std::pair<std::string, std::string>, int64_t> request_ids_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Worker> workers_ ABSL_GUARDED_BY(mu_);  // by id
  absl::flat_hash_map<int64_t, std::vector<std::weak_ptr<JobWatch>>> watches_ ABSL_GUARDED_BY(mu_);
  int64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t next_call_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<int64_t, std::shared_ptr<PendingCall>> pending_calls_ ABSL_GUARDED_BY(mu_);  // by call_id
  std::map<int64_t, SequenceState> sequences_ ABSL_GUARDED_BY(mu_);                     // by job id
  // The last checkpoint recorded per job (step, directory), so a report repeated is not recorded twice.
  std::map<int64_t, std::pair<int64_t, std::string>> recorded_checkpoints_ ABSL_GUARDED_BY(mu_);
};

}  // namespace odyssey::server
