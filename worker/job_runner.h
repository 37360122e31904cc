// JobRunner: runs one assigned job (one rank of it) on its own thread with the engine
// (worker/engine_job.h says what a run does) and reports through callbacks in odyssey.v1
// messages: progress (throttled to progress_interval_seconds, plus every checkpoint and the
// run's first and last steps) and exactly one result.
//
// RL_SESSION assignments run an RlSession (worker/rl_session.h) instead: the trainer is built
// like an SFT run's and resumed from resume_from when set; then TrainingCalls handed to
// Submit() are executed one at a time in the order submitted (a FIFO; calls submitted while the
// model loads wait), each answered through callbacks.reply. Progress is reported after every
// optim_step, load_checkpoint and save_checkpoint (step = optimizer steps, loss = the last
// forward_backward's, checkpoint = the folder a save_checkpoint wrote). The session ends when
// cancelled (result `cancelled`) or when no call arrived for spec.rl.idle_timeout_seconds
// (0 = 3600) since the last one ended (result ok: the job SUCCEEDED); the idle timeout is the
// worker's, so it holds also while the controller is away. Calls still queued at the end are
// answered ABORTED.
// Thread safety: Cancel(), Submit() and done() may be called from any thread; the callbacks
// are called from the run's thread. The destructor cancels and joins.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "odyssey/v1/odyssey.pb.h"
#include "worker/engine_job.h"

namespace odyssey::worker {

class WorkerMetrics;

struct JobRunnerOptions {
  std::string device = "auto";  // the worker's device: auto | cpu | cuda:N
  // Progress messages are sent at most this often (checkpoints and the last step always).
  double progress_interval_seconds = 0.25;
  // A rank whose collective failed waits this long for a cancel before failing the job (see
  // engine_job.h).
  double peer_loss_grace_seconds = 30;
};

struct JobCallbacks {
  std::function<void(const odyssey::v1::JobProgress&)> progress;
  std::function<void(const odyssey::v1::JobResult&)> done;  // called once, last
  std::function<void(const odyssey::v1::TrainingReply&)> reply;  // RL sessions: one per call, before done
};

class JobRunner {
 public:
  // Starts the run's thread. `metrics` may be null; it must outlive the runner.
  JobRunner(odyssey::v1::Assignment assignment, JobRunnerOptions options, JobCallbacks callbacks,
            WorkerMetrics* metrics);
  ~JobRunner();
  JobRunner(const JobRunner&) = delete;
  JobRunner& operator=(const JobRunner&) = delete;

  // Asks the run to stop before its next step; it reports a result with `cancelled` = why.
  void Cancel(const std::string& why);
  // Queues a TrainingCall for this RL session. False (nothing queued) when the run is not an
  // RL session or no longer takes calls (it ended or is ending).
  bool Submit(const odyssey::v1::TrainingCall& call);
  bool done() const { return done_.load(); }
  const std::string& job() const { return assignment_.job(); }

 private:
  void Run();
  // The RL session loop (see above); fills `outcome`.
  void RunRl(const EngineJobOptions& options, EngineOutcome* outcome);

  const odyssey::v1::Assignment assignment_;
  const JobRunnerOptions options_;
  const JobCallbacks callbacks_;
  WorkerMetrics* const metrics_;
  absl::Mutex mu_;
  std::string cancel_reason_ ABSL_GUARDED_BY(mu_);
  std::deque<odyssey::v1::TrainingCall> calls_ ABSL_GUARDED_BY(mu_);  // RL: FIFO of submitted calls
  bool accepting_calls_ ABSL_GUARDED_BY(mu_) = false;                 // RL: Submit() queues
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// The engine's options for an assignment on `device`. Applies the proto's defaults (empty
// model = "tiny", betas 0/0 = 0.9/0.95, eps 0 = 1e-8, batch_size 0 = 1, empty checkpoint_dir =
// spec.checkpoint.directory, ...). Errors name the field.
absl::StatusOr<EngineJobOptions> AssignmentToEngineOptions(const odyssey::v1::Assignment& assignment,
                                                           const std::string& device);

// What this machine offers (engine_job.h's ProbeDevice) as the proto's capabilities (worker_id
// left empty).
absl::StatusOr<odyssey::v1::WorkerCapabilities> ProbeCapabilities(const std::string& device);

}  // namespace odyssey::worker
