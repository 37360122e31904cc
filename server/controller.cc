// The Controller's jobs: construction from the store, persistence (Commit, SetState), the
// JobService calls, path confinement, and Schedule/Assign, which apply the gang scheduler's
// decision (scheduler.h). The other parts of the class: controller.h.
#include "server/controller.h"

#include <algorithm>
#include <filesystem>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/scheduler.h"
#include "server/validation.h"
#include "spdlog/spdlog.h"

namespace odyssey::server {

namespace v1 = odyssey::v1;

namespace {

void SetTimestamp(absl::Time t, google::protobuf::Timestamp* ts) {
  const int64_t nanos = absl::ToUnixNanos(t);
  ts->set_seconds(nanos / 1000000000);
  ts->set_nanos(static_cast<int32_t>(nanos % 1000000000));
}

bool Terminal(v1::Job::State s) {
  return s == v1::Job::SUCCEEDED || s == v1::Job::FAILED || s == v1::Job::CANCELLED;
}

std::string StateName(v1::Job::State s) { return v1::Job::State_Name(s); }

int32_t WorldSize(const v1::JobSpec& spec) { return std::max(1, spec.parallel().world_size()); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// JobWatch

std::optional<v1::JobEvent> JobWatch::Next(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !events_.empty() || finished_; };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (events_.empty()) return std::nullopt;
  v1::JobEvent event = std::move(events_.front());
  events_.pop_front();
  return event;
}

bool JobWatch::done() const {
  absl::MutexLock lock(&mu_);
  return finished_ && events_.empty();
}

void JobWatch::Push(v1::JobEvent event) {
  absl::MutexLock lock(&mu_);
  events_.push_back(std::move(event));
}

void JobWatch::Finish() {
  absl::MutexLock lock(&mu_);
  finished_ = true;
}

// ---------------------------------------------------------------------------------------------
// Controller

Controller::Controller(ControllerOptions options, std::unique_ptr<JobStore> store)
    : options_(std::move(options)), metrics_(options_.registry.get()), store_(std::move(store)) {}

Controller::~Controller() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, w] : workers_) {
    if (w.connection) w.connection->Close();
  }
}

absl::StatusOr<std::unique_ptr<Controller>> Controller::Create(ControllerOptions options,
                                                               std::unique_ptr<JobStore> store) {
  std::unique_ptr<Controller> c(new Controller(std::move(options), std::move(store)));
  absl::MutexLock lock(&c->mu_);
  // Call ids of this process never repeat an earlier process's (replies of calls sent before a
  // restart may still arrive).
  c->next_call_id_ = std::max<int64_t>(1, absl::ToUnixMicros(absl::Now()));
  auto jobs = c->store_->LoadJobs();
  if (!jobs.ok()) return jobs.status();
  auto request_ids = c->store_->LoadRequestIds();
  if (!request_ids.ok()) return request_ids.status();
  const absl::Time now = c->options_.clock();
  int running = 0;
  for (auto& [id, job] : *jobs) {
    job.set_name(JobName(id));
    if (job.state() == v1::Job::RUNNING) {
      ++running;
      // Its workers get heartbeat_timeout to re-attach and report the job as held.
      for (const std::string& wid : job.workers()) {
        Worker& w = c->workers_[wid];
        w.id = wid;
        w.disconnected_since = now;
        w.job = id;
      }
    }
    c->jobs_.emplace(id, std::move(job));
  }
  for (auto& rid : *request_ids) c->request_ids_[{std::move(rid.tenant), std::move(rid.request_id)}] = rid.job_id;
  spdlog::info("controller: loaded {} jobs ({} running) from the store", c->jobs_.size(), running);
  c->UpdateGauges();
  return c;
}

v1::Job* Controller::FindJob(int64_t id) {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

absl::StatusOr<v1::Job*> Controller::FindTenantJob(int64_t id, const std::string& tenant,
                                                   absl::string_view field) {
  v1::Job* job = FindJob(id);
  if (!job) return absl::NotFoundError(absl::StrCat(field, ": ", JobName(id), " does not exist"));
  if (job->tenant() != tenant) {
    spdlog::warn("job={} refused to tenant \"{}\" (it belongs to \"{}\")", job->name(), tenant, job->tenant());
    return absl::PermissionDeniedError(absl::StrCat(field, ": ", job->name(), " belongs to another tenant"));
  }
  return job;
}

void Controller::Commit(int64_t id, std::optional<v1::JobEvent> event) {
  v1::Job& job = jobs_.at(id);
  if (absl::Status s = store_->UpdateJob(id, job); !s.ok()) {
    spdlog::error("job={} store update failed: {}", job.name(), s.ToString());
  }
  if (!event) return;
  event->set_job(job.name());
  SetTimestamp(options_.clock(), event->mutable_time());
  if (absl::Status s = store_->AppendEvent(id, *event); !s.ok()) {
    spdlog::error("job={} store event failed: {}", job.name(), s.ToString());
  }
  auto it = watches_.find(id);
  if (it == watches_.end()) return;
  const bool end = event->has_state() && Terminal(event->state());
  for (auto& weak : it->second) {
    if (auto watch = weak.lock()) {
      watch->Push(*event);
      if (end) watch->Finish();
    }
  }
  if (end) {
    watches_.erase(it);
  } else {
    std::erase_if(it->second, [](const std::weak_ptr<JobWatch>& w) { return w.expired(); });
  }
}

void Controller::SetState(int64_t id, v1::Job::State state, const std::string& message) {
  v1::Job& job = jobs_.at(id);
  if (!message.empty()) {
    v1::JobEvent note;
    note.set_message(message);
    Commit(id, note);
  }
  const bool was_running = job.state() == v1::Job::RUNNING;
  job.set_state(state);
  if (state != v1::Job::PENDING) {
    job.clear_pending_reason();
    job.clear_beyond_fleet();
  }
  if (was_running && state != v1::Job::RUNNING) {
    FailPendingCalls(id, "", absl::AbortedError(absl::StrCat(job.name(), " is now ", StateName(state),
                                                             " (the call was pending: it may or may not have run)")));
  }
  if (Terminal(state)) {
    sequences_.erase(id);
    recorded_checkpoints_.erase(id);
    metrics_.RemoveJob(job.name());
  }
  const absl::Time now = options_.clock();
  if (state == v1::Job::RUNNING && !job.has_start_time()) SetTimestamp(now, job.mutable_start_time());
  if (Terminal(state)) SetTimestamp(now, job.mutable_end_time());
  spdlog::info("job={} state={} {}", job.name(), StateName(state), message);
  v1::JobEvent event;
  event.set_state(state);
  Commit(id, event);
  UpdateGauges();
}

void Controller::SendTo(const std::string& worker_id, const v1::ControllerMessage& message) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || !it->second.connection) return;
  it->second.connection->Send(message);
}

int RendezvousPort(int base, int64_t id, int64_t attempt) {
  // The window: 10000 ports from base, fewer where they would pass 65535.
  const int64_t window = std::clamp<int64_t>(65536 - int64_t{base}, 1, 10000);
  // The largest stride up to half the window that is coprime with it (4999 for 10000).
  int64_t stride = window / 2;
  while (stride > 1 && std::gcd(stride, window) != 1) --stride;
  return base + static_cast<int>((id % window + (attempt % window) * stride) % window);
}

void Controller::CancelRanks(int64_t id, const std::string& except) {
  v1::ControllerMessage cancel;
  cancel.set_cancel(JobName(id));
  for (const std::string& wid : jobs_.at(id).workers()) {
    if (wid != except) SendTo(wid, cancel);
  }
}

void Controller::UpdateGauges() {
  ControllerMetrics::JobCounts counts = {};
  for (const auto& [id, job] : jobs_) {
    if (job.state() >= 0 && job.state() < 6) ++counts[static_cast<size_t>(job.state())];
  }
  metrics_.SetJobs(counts);
  int idle = 0, busy = 0, disconnected = 0;
  for (const auto& [wid, w] : workers_) {
    if (w.session == 0) {
      ++disconnected;
    } else if (w.Idle()) {
      ++idle;
    } else {
      ++busy;
    }
  }
  metrics_.SetWorkers(idle, busy, disconnected);
}

// ---------------------------------------------------------------------------------------------
// JobService

absl::Status Controller::CheckPaths(const v1::JobSpec& spec, const std::string& tenant) const {
  if (absl::Status s = CheckJobSpecPaths(spec, options_.paths, tenant, "spec"); !s.ok()) return s;
  if (options_.paths.enabled() && spec.checkpoint().directory().empty()) {
    // The id is not known yet: job-0 stands for it (only the existing prefix can be a link).
    absl::Status s = options_.paths.Check(DefaultCheckpointDir(0, tenant), PathPolicy::Access::kWrite, tenant,
                                          "spec.checkpoint.directory (empty: the default folder)");
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Controller::CheckPaths(const v1::TrainingCall& call, const std::string& tenant) const {
  return CheckTrainingCallPaths(call, options_.paths, tenant);
}

std::string Controller::DefaultCheckpointDir(int64_t id, const std::string& tenant) const {
  if (options_.paths.enabled()) return absl::StrCat(options_.paths.TenantFolder(tenant), "/checkpoints/job-", id);
  return absl::StrCat(options_.checkpoint_root, "/job-", id);
}

std::string Controller::CheckpointDirOf(int64_t id) {
  const v1::Job& job = jobs_.at(id);
  return job.spec().checkpoint().directory().empty() ? DefaultCheckpointDir(id, job.tenant())
                                                      : job.spec().checkpoint().directory();
}

std::string Controller::CheckpointOwner(int64_t id) { return absl::StrCat(store_->store_id(), "/", JobName(id)); }

absl::Status Controller::CheckFolderFree(const v1::JobSpec& spec, const std::string& tenant) {
  if (spec.checkpoint().directory().empty()) return absl::OkStatus();
  // One spelling per folder ("/a/b/", "/a/./b" and "/a/b" are one); links are the workers' to
  // catch (their owner check reads the folder itself).
  auto normal = [](const std::string& dir) {
    std::error_code ec;
    std::string s = std::filesystem::absolute(dir, ec).lexically_normal().string();
    while (s.size() > 1 && s.back() == '/') s.pop_back();
    return s;
  };
  const std::string wanted = normal(spec.checkpoint().directory());
  for (const auto& [id, job] : jobs_) {
    if (job.state() != v1::Job::PENDING && job.state() != v1::Job::RUNNING) continue;
    if (normal(CheckpointDirOf(id)) != wanted) continue;
    const std::string by = job.tenant() == tenant ? JobName(id) : std::string("another tenant's job");
    return absl::FailedPreconditionError(absl::StrCat(
        "spec.checkpoint.directory: \"", spec.checkpoint().directory(), "\" is in use by ", by, " (",
        StateName(job.state()), "): a checkpoint folder serves one live job at a time (its keep-K pruning and step "
        "folders are that job's); choose another folder or wait until ", by, " ends"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Job> Controller::CreateJob(const v1::CreateJobRequest& request, const std::string& tenant) {
  if (absl::Status s = CheckPaths(request.spec(), tenant); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (!request.request_id().empty()) {
    auto it = request_ids_.find(std::make_pair(tenant, request.request_id()));
    if (it != request_ids_.end()) {
      const v1::Job& existing = jobs_.at(it->second);
      if (!google::protobuf::util::MessageDifferencer::Equals(existing.spec(), request.spec())) {
        return absl::InvalidArgumentError(absl::StrCat("request_id: \"", request.request_id(),
                                                       "\" was already used for ", existing.name(),
                                                       " with a different spec"));
      }
      return existing;
    }
  }
  if (absl::Status free = CheckFolderFree(request.spec(), tenant); !free.ok()) return free;
  if (absl::Status fits = CheckFits(request.spec()); !fits.ok()) return fits;
  v1::Job job;
  *job.mutable_spec() = request.spec();
  job.set_tenant(tenant);
  job.set_state(v1::Job::PENDING);
  SetTimestamp(options_.clock(), job.mutable_create_time());
  auto id = store_->InsertJob(job, request.request_id());
  if (!id.ok()) {
    return absl::UnavailableError(absl::StrCat("job store: ", id.status().message()));
  }
  job.set_name(JobName(*id));
  jobs_.emplace(*id, std::move(job));
  if (!request.request_id().empty()) request_ids_[{tenant, request.request_id()}] = *id;
  metrics_.JobCreated();
  spdlog::info("job={} created (tenant \"{}\", world_size {}, {} steps, model {})", JobName(*id), tenant,
               WorldSize(request.spec()), request.spec().steps(), request.spec().model().name());
  v1::JobEvent event;
  event.set_state(v1::Job::PENDING);
  Commit(*id, event);
  UpdateGauges();
  Schedule();
  return jobs_.at(*id);
}

absl::StatusOr<v1::Job> Controller::GetJob(int64_t id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<v1::Job*> job = FindTenantJob(id, tenant);
  if (!job.ok()) return job.status();
  return **job;
}

absl::Status Controller::CheckJobAccess(int64_t id, const std::string& tenant, absl::string_view field) {
  absl::MutexLock lock(&mu_);
  return FindTenantJob(id, tenant, field).status();
}

absl::StatusOr<v1::ListJobsResponse> Controller::ListJobs(const v1::ListJobsRequest& request,
                                                          const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  const int32_t page_size = request.page_size() == 0 ? kDefaultPageSize : request.page_size();
  int64_t below = INT64_MAX;
  // (ValidateListJobsRequest refused a token that is not a positive id; no exception on a bad one here.)
  if (!request.page_token().empty() && !absl::SimpleAtoi(request.page_token(), &below))
    return absl::InvalidArgumentError(absl::StrCat("page_token: \"", request.page_token(), "\" is not a token"));
  v1::ListJobsResponse response;
  // Newest first: descending ids; the page token is the last id returned.
  for (auto it = std::make_reverse_iterator(jobs_.lower_bound(below)); it != jobs_.rend(); ++it) {
    if (it->second.tenant() != tenant) continue;
    if (request.state() != v1::Job::STATE_UNSPECIFIED && it->second.state() != request.state()) continue;
    if (response.jobs_size() == page_size) {
      response.set_next_page_token(absl::StrCat(response.jobs(page_size - 1).name().substr(5)));
      break;
    }
    *response.add_jobs() = it->second;
  }
  return response;
}

absl::StatusOr<v1::Job> Controller::CancelJob(int64_t id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<v1::Job*> found = FindTenantJob(id, tenant);
  if (!found.ok()) return found.status();
  v1::Job* job = *found;
  switch (job->state()) {
    case v1::Job::CANCELLED:
      return *job;
    case v1::Job::PENDING:
      SetState(id, v1::Job::CANCELLED, "cancelled by request");
      break;
    case v1::Job::RUNNING:
      CancelRanks(id, "");
      SetState(id, v1::Job::CANCELLED, "cancelled by request; workers told to stop");
      break;
    default:
      return absl::FailedPreconditionError(
          absl::StrCat("name: job ", job->name(), " is ", StateName(job->state()),
                       "; only PENDING or RUNNING jobs can be cancelled"));
  }
  Schedule();
  return *FindJob(id);
}

absl::StatusOr<std::shared_ptr<JobWatch>> Controller::WatchJob(int64_t id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<v1::Job*> found = FindTenantJob(id, tenant);
  if (!found.ok()) return found.status();
  const v1::Job* job = *found;
  auto watch = std::make_shared<JobWatch>();
  v1::JobEvent current;
  current.set_job(job->name());
  SetTimestamp(options_.clock(), current.mutable_time());
  if (job->step() > 0) {
    v1::JobEvent step = current;
    step.mutable_step()->set_step(job->step());
    step.mutable_step()->set_loss(job->loss());
    step.mutable_step()->set_tokens_per_second(job->tokens_per_second());
    current.set_state(job->state());
    watch->Push(current);
    watch->Push(step);
  } else {
    current.set_state(job->state());
    watch->Push(current);
  }
  if (Terminal(job->state())) {
    watch->Finish();
  } else {
    watches_[id].push_back(watch);
  }
  return watch;
}

absl::StatusOr<v1::ListJobEventsResponse> Controller::ListJobEvents(int64_t id,
                                                                   const v1::ListJobEventsRequest& request,
                                                                   const std::string& tenant) {
  {
    absl::MutexLock lock(&mu_);
    if (absl::StatusOr<v1::Job*> found = FindTenantJob(id, tenant); !found.ok()) return found.status();
  }
  // The page is read outside mu_: the store serializes its own connection, and a slow read of a
  // long history must not hold up the workers' streams and the other calls.
  const int64_t page_size = request.page_size() == 0 ? kDefaultEventPageSize : request.page_size();
  int64_t after = 0;  // validated (ValidateListJobEventsRequest): a positive event number
  if (!request.page_token().empty() && !absl::SimpleAtoi(request.page_token(), &after))
    return absl::InvalidArgumentError(absl::StrCat("page_token: \"", request.page_token(), "\" is not a token"));
  // One more than the page: whether it is there decides next_page_token.
  auto events = store_->LoadEventPage(id, after, page_size + 1);
  if (!events.ok()) return absl::InternalError(absl::StrCat("the job store: ", events.status().message()));
  v1::ListJobEventsResponse response;
  for (int64_t i = 0; i < std::min<int64_t>(page_size, std::ssize(*events)); ++i) {
    *response.add_events() = std::move((*events)[i].second);
  }
  if (std::ssize(*events) > page_size) response.set_next_page_token(absl::StrCat((*events)[page_size - 1].first));
  return response;
}

// ---------------------------------------------------------------------------------------------
// Scheduling: the decision is scheduler.h's; here it is applied.

void Controller::Schedule() {
  std::vector<QueuedJob> queue;
  for (const auto& [id, job] : jobs_) {
    if (job.state() == v1::Job::PENDING) queue.push_back({id, job.spec().priority(), WorldSize(job.spec())});
  }
  if (queue.empty()) return;
  std::vector<IdleWorker> idle;
  Fleet fleet;
  fleet.attached = static_cast<int>(workers_.size());
  for (const auto& [id, w] : workers_) {
    if (w.Idle()) {
      idle.push_back({w.id, w.host});
    } else {
      fleet.busy.push_back({w.id, w.session == 0       ? "no stream (reconnecting)"
                                  : w.awaiting_held     ? "returning"
                                  : !w.stopping.empty() ? absl::StrCat("stopping ", JobName(*w.stopping.begin()))
                                  : w.leaving           ? "shutting down"
                                  : jobs_.count(w.job) && jobs_.at(w.job).spec().kind() == v1::RL_SESSION
                                      ? absl::StrCat(JobName(w.job), " (an RL session: it holds the worker until it "
                                                                    "ends or idles out)")
                                      : JobName(w.job)});
    }
  }
  // Jobs stored before --path-root was set (or under other roots) are judged again when they
  // start, restarts included: a spec an earlier configuration accepted must not run with
  // paths the current one refuses. The workers go to the next job.
  auto admit = [this](int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!options_.paths.enabled()) return absl::OkStatus();
    const v1::Job& job = jobs_.at(id);
    return CheckPaths(job.spec(), job.tenant());
  };
  const ScheduleDecision decision = ScheduleGangs(std::move(queue), std::move(idle), admit, &fleet);
  for (const GangWait& w : decision.waiting) {
    v1::Job& job = jobs_.at(w.job);
    if (job.pending_reason() == w.reason && job.beyond_fleet() == w.beyond_fleet) continue;
    job.set_pending_reason(w.reason);
    job.set_beyond_fleet(w.beyond_fleet);
    v1::JobEvent note;  // watchers see why it waits, once per change
    note.set_message(absl::StrCat("waiting: ", w.reason));
    Commit(w.job, note);
  }
  for (const GangRefusal& r : decision.refused) {
    v1::Job& job = jobs_.at(r.job);
    job.set_error(absl::StrCat("refused when starting (--path-root): ", r.why));
    SetState(r.job, v1::Job::FAILED, job.error());
  }
  for (const GangStart& start : decision.starts) Assign(start.job, start.workers);
}

void Controller::Assign(int64_t id, const std::vector<std::string>& worker_ids) {
  v1::Job& job = jobs_.at(id);
  job.clear_workers();
  for (const std::string& wid : worker_ids) {
    job.add_workers(wid);
    workers_.at(wid).job = id;
  }
  const int64_t attempt = int64_t{job.restarts()} + job.rendezvous_retries();  // each one moves the port
  const std::string rendezvous =
      absl::StrCat(workers_.at(worker_ids[0]).host, ":", RendezvousPort(options_.rendezvous_port_base, id, attempt));
  const std::string checkpoint_dir = CheckpointDirOf(id);
  for (size_t rank = 0; rank < worker_ids.size(); ++rank) {
    v1::ControllerMessage message;
    v1::Assignment* a = message.mutable_assign();
    a->set_job(job.name());
    *a->mutable_spec() = job.spec();
    a->set_rank(static_cast<int32_t>(rank));
    a->set_world_size(static_cast<int32_t>(worker_ids.size()));
    a->set_rendezvous(rendezvous);
    a->set_resume_from(job.last_checkpoint());
    a->set_checkpoint_dir(checkpoint_dir);
    a->set_checkpoint_owner(CheckpointOwner(id));
    SendTo(worker_ids[rank], message);
  }
  SetState(id, v1::Job::RUNNING,
           absl::StrCat("assigned to ", absl::StrJoin(worker_ids, ","),
                        job.last_checkpoint().empty() ? "" : absl::StrCat(", resuming from ", job.last_checkpoint())));
}

}  // namespace odyssey::server
