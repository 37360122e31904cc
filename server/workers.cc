// The worker registry: WorkerService (attach, a worker's messages, detach), liveness (Tick), and
// what losing a rank does to its job (RankLost: restart from the last checkpoint, or fail).
// Controller member functions over workers_ and jobs_ (controller.h).
#include "server/controller.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/wire_text.h"
#include "server/validation.h"
#include "spdlog/spdlog.h"

namespace odyssey::server {

namespace v1 = odyssey::v1;

Controller::Worker* Controller::WorkerBySession(int64_t session) {
  if (session == 0) return nullptr;
  for (auto& [id, w] : workers_) {
    if (w.session == session) return &w;
  }
  return nullptr;
}

absl::StatusOr<int64_t> Controller::AttachWorker(const v1::WorkerCapabilities& capabilities,
                                                 const std::string& peer_host,
                                                 std::shared_ptr<WorkerConnection> connection) {
  if (capabilities.worker_id().empty()) {
    return absl::InvalidArgumentError("hello.worker_id: is required (stable across reconnects)");
  }
  absl::MutexLock lock(&mu_);
  if (auto live = workers_.find(capabilities.worker_id()); live != workers_.end() && live->second.session != 0) {
    // A second process with a live worker's id (a copy-pasted flag, a restarted pod whose old
    // stream has not ended yet) must not take over the first one's job.
    const Worker& old = live->second;
    return absl::AlreadyExistsError(absl::StrCat(
        "hello.worker_id: \"", WireText(old.id, 128), "\" is attached on a live stream (from ", old.host, " since ",
        absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", old.attached_at, absl::UTCTimeZone()),
        "); an id is refused until that stream ends or goes silent for heartbeat_timeout (",
        absl::FormatDuration(options_.heartbeat_timeout), "): give each worker its own --worker-id"));
  }
  Worker& w = workers_[capabilities.worker_id()];
  w.id = capabilities.worker_id();
  w.capabilities = capabilities;
  w.host = peer_host.empty() ? capabilities.hostname() : peer_host;
  w.session = next_session_++;
  w.connection = std::move(connection);
  w.last_seen = options_.clock();
  w.attached_at = w.last_seen;
  w.job_at_attach = w.job;
  w.awaiting_held = true;  // returning: nothing is assigned until its `held` is read
  w.leaving = false;       // a new process (one that left does not attach again)
  spdlog::info("worker={} attached from {} (device {}{})", w.id, w.host, capabilities.device(),
               w.job ? absl::StrCat(", holds ", JobName(w.job)) : "");
  const int64_t session = w.session;
  UpdateGauges();
  Schedule();
  return session;
}

void Controller::OnWorkerMessage(int64_t session, const v1::WorkerMessage& message) {
  absl::MutexLock lock(&mu_);
  Worker* w = WorkerBySession(session);
  if (!w) return;
  w->last_seen = options_.clock();
  switch (message.msg_case()) {
    case v1::WorkerMessage::kProgress:
      OnProgress(*w, message.progress());
      break;
    case v1::WorkerMessage::kResult:
      OnResult(*w, message.result());
      break;
    case v1::WorkerMessage::kHeld:
      OnHeld(*w, message.held());
      break;
    case v1::WorkerMessage::kReply:
      OnReply(*w, message.reply());
      break;
    default:  // heartbeat, a repeated hello: liveness only
      break;
  }
}

void Controller::OnProgress(Worker& w, const v1::JobProgress& progress) {
  auto id = ParseJobName(progress.job());
  v1::Job* job = id.ok() ? FindJob(*id) : nullptr;
  if (!job || job->state() != v1::Job::RUNNING || progress.rank() < 0 ||
      progress.rank() >= job->workers_size() || job->workers(progress.rank()) != w.id) {
    if (id.ok() && w.job != *id) {
      // A run the controller no longer wants (cancelled, restarted elsewhere): stop it.
      v1::ControllerMessage cancel;
      cancel.set_cancel(progress.job());
      SendTo(w.id, cancel);
    }
    return;
  }
  if (progress.rank() != 0) return;
  v1::StepMetrics m = progress.metrics();
  // An RL session's loss is its last ForwardBackward's batch loss, taken from the (merged)
  // reply in ApplyReply: rank 0 of a multi-rank session only knows its own share.
  if (job->spec().kind() == v1::RL_SESSION) m.set_loss(job->loss());
  job->set_step(m.step());
  job->set_loss(m.loss());
  job->set_tokens_per_second(m.tokens_per_second());
  // RL sessions count their positions from the (merged) ForwardBackward replies instead.
  if (m.tokens() > 0 && job->spec().kind() != v1::RL_SESSION) metrics_.AddTokens(m.tokens());
  // An RL session's figures come from its (merged) replies in ApplyReply.
  if (m.step() > 0 && job->spec().kind() != v1::RL_SESSION) {
    metrics_.SetLoss(job->name(), m.loss());
    metrics_.SetOptimizerFigures(job->name(), m.grad_norm(), m.lr());
  }
  if (m.step_seconds() > 0) metrics_.ObserveStep(m.step_seconds());
  v1::JobEvent event;
  *event.mutable_step() = m;
  Commit(*id, event);
  if (!progress.checkpoint().empty()) RecordCheckpoint(*id, m.step(), progress.checkpoint());
}

void Controller::RecordCheckpoint(int64_t id, int64_t step, const std::string& directory) {
  v1::Job& job = jobs_.at(id);
  // An RL session's save is reported twice (the SaveCheckpoint reply and rank 0's progress):
  // recorded once.
  auto [it, fresh] = recorded_checkpoints_.try_emplace(id, step, directory);
  if (!fresh) {
    if (it->second == std::make_pair(step, directory)) return;
    it->second = {step, directory};
  }
  job.set_last_checkpoint(directory);
  if (absl::Status s = store_->AddCheckpoint(id, step, directory); !s.ok()) {
    spdlog::error("job={} store checkpoint failed: {}", job.name(), s.ToString());
  }
  spdlog::info("job={} checkpoint step={} dir={}", job.name(), step, directory);
  v1::JobEvent ckpt;
  ckpt.set_checkpoint(directory);
  Commit(id, ckpt);
}

void Controller::OnResult(Worker& w, const v1::JobResult& result) {
  auto id = ParseJobName(result.job());
  if (!id.ok()) return;
  if (w.job == *id) w.job = 0;
  w.stopping.erase(*id);
  if (!result.ok() && result.worker_leaving()) {
    w.leaving = true;
    spdlog::info("worker={} is shutting down: no more jobs for it", w.id);
  }
  v1::ControllerMessage release;
  release.set_release(result.job());
  SendTo(w.id, release);

  v1::Job* job = FindJob(*id);
  if (job && job->state() == v1::Job::RUNNING && result.rank() >= 0 &&
      result.rank() < job->workers_size() && job->workers(result.rank()) == w.id) {
    if (result.ok()) {
      if (result.rank() == 0) {
        job->set_step(std::max(job->step(), result.step()));
        if (!result.last_checkpoint().empty()) job->set_last_checkpoint(result.last_checkpoint());
        SetState(*id, v1::Job::SUCCEEDED, "");
      }
    } else if (result.worker_leaving()) {
      // Its worker leaves (SIGTERM: a pod deleted, a node drained); the job is not at fault. As
      // for a lost worker: a restart from the last checkpoint while restart_limit allows.
      RankLost(*id, w.id, absl::StrCat("worker ", w.id, " (rank ", result.rank(), ") is shutting down"));
    } else {
      // Bounded and valid whatever the worker sent (common/wire_text.h): it is stored and shown.
      const std::string why = WireText(result.cancelled().empty() ? result.error()
                                                                  : absl::StrCat("stopped: ", result.cancelled()));
      const std::string where = absl::StrCat("rank ", result.rank(), " (worker ", w.id, "): ", why);
      CancelRanks(*id, w.id);
      const bool did_not_meet = result.cancelled().empty() && result.rendezvous_failed();
      if (did_not_meet && job->rendezvous_retries() < kRendezvousRetryLimit) {
        // The ranks did not meet (the port taken, a rank late): nothing ran; again on another port.
        job->set_rendezvous_retries(job->rendezvous_retries() + 1);
        job->clear_workers();
        metrics_.RendezvousRetried();
        SetState(*id, v1::Job::PENDING,
                 absl::StrCat(where, "; the ranks did not meet: rendezvous retry ", job->rendezvous_retries(), " of ",
                              kRendezvousRetryLimit, " on another port"));
      } else {
        job->set_error(did_not_meet
                           ? absl::StrCat(where, "; the ranks did not meet in ", kRendezvousRetryLimit + 1, " attempts")
                           : where);
        SetState(*id, v1::Job::FAILED, job->error());
      }
    }
  }
  UpdateGauges();
  Schedule();
}

void Controller::OnHeld(Worker& w, const v1::HeldJobs& held) {
  if (!w.awaiting_held) return;  // only the first `held` of a stream reconciles
  w.awaiting_held = false;
  const int64_t expected = w.job_at_attach;
  w.job_at_attach = 0;
  bool holds_expected = false;
  for (const std::string& name : held.jobs()) {
    auto id = ParseJobName(name);
    if (!id.ok()) continue;
    const v1::Job* job = FindJob(*id);
    const bool listed = job && job->state() == v1::Job::RUNNING &&
                        std::find(job->workers().begin(), job->workers().end(), w.id) != job->workers().end();
    if (listed && (w.job == 0 || w.job == *id)) {
      w.job = *id;
      if (*id == expected) holds_expected = true;
      spdlog::info("job={} worker={} re-attached and still runs it", name, w.id);
    } else if (!listed || w.job != *id) {
      // A job the controller gave up on here (restarted elsewhere, cancelled, ended) or a result
      // not yet released: told to stop, and the worker is busy until its JobResult arrives
      // (the worker re-sends unreleased results right after `held`). That includes the job it
      // was last given when that job ended while the worker was away (a cancel it never got):
      // the worker still runs it, so it is no longer this worker's job but it is held.
      if (w.job == *id) {
        w.job = 0;
        if (*id == expected) holds_expected = true;
      }
      v1::ControllerMessage cancel;
      cancel.set_cancel(name);
      SendTo(w.id, cancel);
      w.stopping.insert(*id);
      spdlog::info("job={} worker={} came back still holding it; told to stop, no new job until it does", name,
                   w.id);
    }
  }
  if (expected != 0 && !holds_expected && w.job == expected) {
    // The worker came back without its job (e.g. it restarted): that rank is lost.
    w.job = 0;
    RankLost(expected, w.id, absl::StrCat("worker ", w.id, " re-attached without the job"));
  }
  UpdateGauges();
  Schedule();
}

void Controller::DetachWorker(int64_t session) {
  absl::MutexLock lock(&mu_);
  Worker* w = WorkerBySession(session);
  if (!w) return;
  w->session = 0;
  w->connection = nullptr;
  w->awaiting_held = false;
  w->disconnected_since = options_.clock();
  FailPendingCalls(0, w->id, absl::UnavailableError(absl::StrCat(
                                 "worker ", w->id, " disconnected while the call was pending; it may or may not "
                                 "have run. The session resumes from its last checkpoint if the worker is lost")));
  spdlog::info("worker={} disconnected{}", w->id, w->job ? absl::StrCat(" (holds ", JobName(w->job), ")") : "");
  UpdateGauges();
}

void Controller::RankLost(int64_t id, const std::string& worker_id, const std::string& why) {
  v1::Job* job = FindJob(id);
  if (!job || job->state() != v1::Job::RUNNING) return;
  CancelRanks(id, worker_id);
  if (job->restarts() < job->spec().restart_limit()) {
    job->set_restarts(job->restarts() + 1);
    job->clear_workers();
    metrics_.JobRestarted();
    SetState(id, v1::Job::PENDING,
             absl::StrCat(why, "; restart ", job->restarts(), " of ", job->spec().restart_limit(), " from ",
                          job->last_checkpoint().empty() ? "the start" : job->last_checkpoint()));
  } else {
    job->set_error(absl::StrCat(why, "; restart_limit (", job->spec().restart_limit(), ") reached"));
    SetState(id, v1::Job::FAILED, job->error());
  }
}

void Controller::WorkerDead(const std::string& worker_id, const std::string& why) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return;
  if (it->second.connection) it->second.connection->Close();
  const int64_t job = it->second.job;
  workers_.erase(it);
  spdlog::warn("worker={} dead: {}", worker_id, why);
  if (job != 0) RankLost(job, worker_id, absl::StrCat("worker ", worker_id, " lost (", why, ")"));
}

void Controller::Tick() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock();
  std::vector<std::pair<std::string, std::string>> dead;
  for (const auto& [id, w] : workers_) {
    if (w.session != 0 && now - w.last_seen > options_.heartbeat_timeout) {
      dead.emplace_back(id, absl::StrCat("no message for ", absl::FormatDuration(now - w.last_seen)));
    } else if (w.session == 0 && now - w.disconnected_since > options_.heartbeat_timeout) {
      dead.emplace_back(id, absl::StrCat("did not re-attach within ", absl::FormatDuration(options_.heartbeat_timeout)));
    }
  }
  for (const auto& [id, why] : dead) WorkerDead(id, why);
  if (!dead.empty()) UpdateGauges();
  Schedule();
}

std::vector<WorkerInfo> Controller::Workers() {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerInfo> out;
  for (const auto& [id, w] : workers_) {
    const char* state = w.session == 0      ? "disconnected"
                        : w.awaiting_held   ? "returning"
                        : !w.stopping.empty() ? "stopping"
                        : w.leaving         ? "leaving"
                        : w.job != 0        ? "busy"
                                            : "idle";
    out.push_back({id, w.session != 0, w.job ? JobName(w.job) : "", state});
  }
  return out;
}

}  // namespace odyssey::server
