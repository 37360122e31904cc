#include "server/controller.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/message_differencer.h"
#include "model/config.h"
#include "planner/planner.h"
#include "server/rl_batch.h"
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

Controller::Worker* Controller::WorkerBySession(int64_t session) {
  if (session == 0) return nullptr;
  for (auto& [id, w] : workers_) {
    if (w.session == session) return &w;
  }
  return nullptr;
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
  if (was_running && state != v1::Job::RUNNING) {
    FailPendingCalls(id, "", absl::AbortedError(absl::StrCat(job.name(), " is now ", StateName(state),
                                                             " (the call was pending: it may or may not have run)")));
  }
  if (Terminal(state)) {
    sequences_.erase(id);
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
    } else if (w.job == 0) {
      ++idle;
    } else {
      ++busy;
    }
  }
  metrics_.SetWorkers(idle, busy, disconnected);
}

// ---------------------------------------------------------------------------------------------
// JobService

Controller::PlanMachine Controller::MachineToPlanFor() const {
  PlanMachine m;
  const planner::Hardware h200;
  m.gpu_bytes = h200.gpu_bytes;
  m.host_bytes = h200.host_bytes;
  m.source = "an H200 host (no GPU worker is attached)";
  for (const auto& [id, w] : workers_) {
    m.any_worker = true;
    if (w.capabilities.device().rfind("cuda", 0) != 0 || w.capabilities.device_memory_bytes() <= 0) continue;
    const int64_t gpu = w.capabilities.device_memory_bytes() - (int64_t{3} << 30);  // context, fragmentation
    const int64_t host = w.capabilities.host_memory_bytes() / 100 * 85;               // leave the OS its share
    if (!m.gpu_worker || gpu > m.gpu_bytes) {
      m.gpu_bytes = gpu;
      m.host_bytes = host;
      m.source = absl::StrCat("worker ", id, " (", w.capabilities.device_name().empty() ? w.capabilities.device()
                                                                                        : w.capabilities.device_name(),
                              ", the largest GPU attached)");
    }
    m.gpu_worker = true;
  }
  return m;
}

absl::Status Controller::CheckFits(const v1::JobSpec& spec) {
  // The planner models one GPU rank, on MachineToPlanFor(); no check when only CPU workers are
  // attached (they are bound by host memory, which the planner does not model).
  const PlanMachine machine = MachineToPlanFor();
  if (machine.any_worker && !machine.gpu_worker) return absl::OkStatus();
  planner::Hardware hardware;
  hardware.gpu_bytes = machine.gpu_bytes;
  hardware.host_bytes = machine.host_bytes;
  auto config = model::ResolveModelConfig(spec.model().name());
  if (!config.ok()) return absl::OkStatus();  // validation has already named the model's problem
  const int64_t batch = std::max<int64_t>(1, spec.data().batch_size());
  auto choice = planner::Choose(planner::ShapeOf(*config), spec.data().seq_len(), batch, hardware);
  if (!choice.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("spec.data.seq_len: ", choice.status().message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PlanResponse> Controller::Plan(const v1::PlanRequest& request) {
  const v1::JobSpec& spec = request.spec();
  auto config = model::ResolveModelConfig(spec.model().name());
  if (!config.ok()) return absl::InvalidArgumentError(absl::StrCat("spec.model.name: ", config.status().message()));
  planner::Hardware hardware;
  std::string source;
  {
    absl::MutexLock lock(&mu_);
    const PlanMachine machine = MachineToPlanFor();
    hardware.gpu_bytes = machine.gpu_bytes;
    hardware.host_bytes = machine.host_bytes;
    source = machine.source;
  }
  if (request.gpu_bytes() > 0 || request.host_bytes() > 0) source = "the request";
  if (request.gpu_bytes() > 0) hardware.gpu_bytes = request.gpu_bytes();
  if (request.host_bytes() > 0) hardware.host_bytes = request.host_bytes();
  if (spec.memory().host_budget_bytes() > 0) hardware.host_bytes = spec.memory().host_budget_bytes();

  const planner::ModelShape shape = planner::ShapeOf(*config);
  const int64_t batch = std::max<int64_t>(1, spec.data().batch_size());
  planner::MemoryFields fields;
  fields.recompute = spec.memory().recompute();
  fields.every_k = spec.memory().recompute_every_k();
  fields.offload = spec.memory().offload();
  fields.mlp_tile = spec.memory().mlp_tile_tokens();
  fields.loss_tile = spec.memory().loss_tile_tokens();

  v1::PlanResponse out;
  out.set_planned_gpu_bytes(hardware.gpu_bytes);
  out.set_planned_host_bytes(hardware.host_bytes);
  out.set_hardware(source);
  if (request.max_seq_len()) out.set_max_seq_len(planner::MaxSeqLen(shape, hardware));
  planner::Strategy strategy;  // every field set by the spec: its defaults are what a worker runs
  if (!fields.AllSet()) {
    auto choice = planner::Choose(shape, spec.data().seq_len(), batch, hardware);
    if (!choice.ok()) {  // no strategy: the planner's message says by how much the best one misses
      out.set_fits(false);
      out.set_message(std::string(choice.status().message()));
      return out;
    }
    strategy = choice->strategy;
  }
  planner::Request r;
  r.model = shape;
  r.seq_len = spec.data().seq_len();
  r.batch_size = batch;
  r.strategy = planner::ApplyMemoryFields(strategy, fields);
  r.hardware = hardware;
  r.param_bytes = spec.model().dtype() == "float32" ? 4 : 2;
  const planner::Prediction p = planner::Predict(r);
  out.set_fits(p.fits);
  if (!p.fits) {
    auto gib = [](int64_t b) { return absl::StrFormat("%.1f GiB", static_cast<double>(b) / (int64_t{1} << 30)); };
    out.set_message(absl::StrCat("does not fit: the strategy needs ", gib(p.gpu_peak_bytes), " of GPU memory and ",
                                 gib(p.host_bytes), " of pinned host memory; the machine has ", gib(hardware.gpu_bytes),
                                 " / ", gib(hardware.host_bytes)));
  }
  v1::MemorySpec* m = out.mutable_memory();
  m->set_recompute(r.strategy.recompute);
  m->set_recompute_every_k(static_cast<int32_t>(r.strategy.every_k));
  m->set_offload(r.strategy.offload ? "on" : "off");
  m->set_mlp_tile_tokens(r.strategy.mlp_tile);
  m->set_loss_tile_tokens(r.strategy.loss_tile);
  m->set_host_budget_bytes(hardware.host_bytes);
  out.set_device_resident(r.strategy.device_resident);
  out.set_attention_head_groups(static_cast<int32_t>(r.strategy.head_groups));
  out.set_optimizer_on_host(r.strategy.optimizer_on_host);
  out.set_gpu_peak_bytes(p.gpu_peak_bytes);
  out.set_host_bytes(p.host_bytes);
  for (const auto& [name, bytes] : p.terms) {
    v1::PlanTerm* t = out.add_terms();
    t->set_name(name);
    t->set_bytes(bytes);
  }
  return out;
}

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
  if (!request.page_token().empty()) below = std::stoll(request.page_token());
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

// ---------------------------------------------------------------------------------------------
// WorkerService

absl::StatusOr<int64_t> Controller::AttachWorker(const v1::WorkerCapabilities& capabilities,
                                                 const std::string& peer_host,
                                                 std::shared_ptr<WorkerConnection> connection) {
  if (capabilities.worker_id().empty()) {
    return absl::InvalidArgumentError("hello.worker_id: is required (stable across reconnects)");
  }
  absl::MutexLock lock(&mu_);
  Worker& w = workers_[capabilities.worker_id()];
  if (w.connection) {
    w.connection->Close();  // replaced by this newer stream
    FailPendingCalls(0, w.id, absl::UnavailableError(absl::StrCat(
                                  "worker ", w.id, " re-attached while the call was pending; it may or may "
                                  "not have run: check the session (e.g. GetJob's step) before retrying")));
  }
  w.id = capabilities.worker_id();
  w.capabilities = capabilities;
  w.host = peer_host.empty() ? capabilities.hostname() : peer_host;
  w.session = next_session_++;
  w.connection = std::move(connection);
  w.last_seen = options_.clock();
  w.job_at_attach = w.job;
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
  if (m.step_seconds() > 0) metrics_.ObserveStep(m.step_seconds());
  v1::JobEvent event;
  *event.mutable_step() = m;
  Commit(*id, event);
  if (!progress.checkpoint().empty()) {
    job->set_last_checkpoint(progress.checkpoint());
    if (absl::Status s = store_->AddCheckpoint(*id, m.step(), progress.checkpoint()); !s.ok()) {
      spdlog::error("job={} store checkpoint failed: {}", job->name(), s.ToString());
    }
    spdlog::info("job={} checkpoint step={} dir={}", job->name(), m.step(), progress.checkpoint());
    v1::JobEvent ckpt;
    ckpt.set_checkpoint(progress.checkpoint());
    Commit(*id, ckpt);
  }
}

void Controller::OnResult(Worker& w, const v1::JobResult& result) {
  auto id = ParseJobName(result.job());
  if (!id.ok()) return;
  if (w.job == *id) w.job = 0;
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
    } else {
      const std::string why = result.cancelled().empty() ? result.error()
                                                         : absl::StrCat("stopped: ", result.cancelled());
      job->set_error(absl::StrCat("rank ", result.rank(), " (worker ", w.id, "): ", why));
      CancelRanks(*id, w.id);
      SetState(*id, v1::Job::FAILED, job->error());
    }
  }
  UpdateGauges();
  Schedule();
}

void Controller::OnHeld(Worker& w, const v1::HeldJobs& held) {
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
    } else if (w.job != *id) {
      v1::ControllerMessage cancel;
      cancel.set_cancel(name);
      SendTo(w.id, cancel);
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

void Controller::Schedule() {
  std::vector<QueuedJob> queue;
  for (const auto& [id, job] : jobs_) {
    if (job.state() == v1::Job::PENDING) queue.push_back({id, job.spec().priority(), WorldSize(job.spec())});
  }
  if (queue.empty()) return;
  std::vector<IdleWorker> idle;
  for (const auto& [id, w] : workers_) {
    if (w.session != 0 && w.job == 0) idle.push_back({w.id, w.host});
  }
  // Jobs stored before --path-root was set (or under other roots) are judged again when they
  // start, restarts included: a spec an earlier configuration accepted must not run with
  // paths the current one refuses. The workers go to the next job.
  auto admit = [this](int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!options_.paths.enabled()) return absl::OkStatus();
    const v1::Job& job = jobs_.at(id);
    return CheckPaths(job.spec(), job.tenant());
  };
  const ScheduleDecision decision = ScheduleGangs(std::move(queue), std::move(idle), admit);
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
  const std::string rendezvous = absl::StrCat(workers_.at(worker_ids[0]).host, ":",
                                              options_.rendezvous_port_base + id % 10000);
  const std::string checkpoint_dir = job.spec().checkpoint().directory().empty()
                                         ? DefaultCheckpointDir(id, job.tenant())
                                         : job.spec().checkpoint().directory();
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
    SendTo(worker_ids[rank], message);
  }
  SetState(id, v1::Job::RUNNING,
           absl::StrCat("assigned to ", absl::StrJoin(worker_ids, ","),
                        job.last_checkpoint().empty() ? "" : absl::StrCat(", resuming from ", job.last_checkpoint())));
}

// ---------------------------------------------------------------------------------------------
// TrainingService

namespace {

const char* MethodName(v1::TrainingCall::CallCase c) {
  switch (c) {
    case v1::TrainingCall::kForwardBackward: return "ForwardBackward";
    case v1::TrainingCall::kOptimStep: return "OptimStep";
    case v1::TrainingCall::kForward: return "Forward";
    case v1::TrainingCall::kSaveCheckpoint: return "SaveCheckpoint";
    case v1::TrainingCall::kLoadCheckpoint: return "LoadCheckpoint";
    case v1::TrainingCall::kExportWeights: return "ExportWeights";
    default: return "unknown";
  }
}

}  // namespace

void Controller::CountTrainingCall(const std::string& method, absl::StatusCode code) {
  metrics_.CountTrainingCall(method, code);
}

absl::Status Controller::CheckServesTraining(const v1::Job& job) {
  if (job.spec().kind() != v1::RL_SESSION) {
    return absl::FailedPreconditionError(
        absl::StrCat("job: ", job.name(), " is of kind ",
                     job.spec().kind() == v1::JOB_KIND_UNSPECIFIED ? "SFT" : v1::JobKind_Name(job.spec().kind()),
                     "; TrainingService calls need an RL_SESSION job"));
  }
  if (job.state() != v1::Job::RUNNING) {
    return absl::FailedPreconditionError(
        absl::StrCat("job: ", job.name(), " is ", StateName(job.state()),
                     "; TrainingService calls need a RUNNING session",
                     job.state() == v1::Job::PENDING ? " (it waits for a worker; retry later)" : ""));
  }
  return absl::OkStatus();
}

absl::Status Controller::AwaitSequence(int64_t id, int64_t sequence, const std::function<bool()>& cancelled) {
  SequenceState& seq = sequences_[id];
  if (sequence < seq.next) {
    return absl::AlreadyExistsError(absl::StrCat("sequence: ", sequence, " was already received for ", JobName(id),
                                                 " (the next expected is ", seq.next, ")"));
  }
  if (seq.waiting.count(sequence)) {
    return absl::AlreadyExistsError(
        absl::StrCat("sequence: ", sequence, " is already waiting for its turn on ", JobName(id)));
  }
  if (sequence > seq.next) {
    seq.waiting.insert(sequence);
    const absl::Time deadline = absl::Now() + options_.sequence_wait;
    bool client_gone = false;
    auto turn = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      const v1::Job* job = FindJob(id);
      auto it = sequences_.find(id);  // erased when the job ends
      return !job || job->state() != v1::Job::RUNNING || it == sequences_.end() || it->second.next >= sequence;
    };
    while (!turn() && absl::Now() < deadline) {
      mu_.AwaitWithDeadline(absl::Condition(&turn), std::min(deadline, absl::Now() + absl::Seconds(1)));
      if (cancelled && cancelled()) {
        client_gone = true;
        break;
      }
    }
    // The session may have ended (and its sequence state been erased) while this call waited.
    auto it = sequences_.find(id);
    if (it != sequences_.end()) it->second.waiting.erase(sequence);
    if (client_gone) return absl::CancelledError("the client cancelled the call while it waited for its turn");
    if (absl::Status s = CheckServesTraining(*FindJob(id)); !s.ok()) return s;
    const int64_t next = sequences_[id].next;
    if (next < sequence) {
      return absl::AbortedError(absl::StrCat("sequence: call ", sequence, " of ", JobName(id), " waited ",
                                             absl::FormatDuration(options_.sequence_wait), " for call ", next,
                                             ", which did not arrive; send the missing calls, then retry this one"));
    }
    if (next > sequence) {  // a duplicate of this sequence went first
      return absl::AlreadyExistsError(absl::StrCat("sequence: ", sequence, " was already received for ", JobName(id)));
    }
  }
  sequences_[id].next = sequence + 1;
  return absl::OkStatus();
}

absl::Status Controller::RefuseInTurn(int64_t id, int64_t sequence, const std::string& method,
                                      const absl::Status& refusal, const std::function<bool()>& cancelled) {
  absl::Status status = refusal;
  {
    absl::MutexLock lock(&mu_);
    const v1::Job* job = FindJob(id);
    if (sequence > 0 && job != nullptr && CheckServesTraining(*job).ok()) {
      if (absl::Status s = AwaitSequence(id, sequence, cancelled); !s.ok()) status = s;
    }
  }
  CountTrainingCall(method, status.code());
  return status;
}

absl::StatusOr<v1::TrainingReply> Controller::Train(int64_t id, v1::TrainingCall call, int64_t sequence,
                                                    const std::function<bool()>& cancelled) {
  const std::string method = MethodName(call.call_case());
  auto finish = [&](absl::StatusOr<v1::TrainingReply> r) {
    CountTrainingCall(method, r.status().code());
    return r;
  };
  absl::MutexLock lock(&mu_);
  const v1::Job* job = FindJob(id);
  if (!job) return finish(absl::NotFoundError(absl::StrCat("job: ", JobName(id), " does not exist")));
  if (absl::Status s = CheckServesTraining(*job); !s.ok()) return finish(s);
  // A sequenced call takes its turn before anything else can refuse it, so a refusal uses up its
  // number like an answer from the worker would and never leaves a gap behind it.
  if (sequence > 0) {
    if (absl::Status s = AwaitSequence(id, sequence, cancelled); !s.ok()) return finish(s);
    job = FindJob(id);
  }
  // The shard fields are the controller's to set (TrainingCall is internal; clear them anyway).
  call.clear_weight_sum();
  call.clear_datum_offset();
  if (job->workers_size() > 1) return finish(TrainRanks(id, std::move(call), sequence, cancelled));
  const int64_t positions = BatchPositions(call);
  const int64_t limit = RankPositionLimit(job->spec());
  if (positions > limit) {
    return finish(absl::InvalidArgumentError(absl::StrCat(
        "batch: ", positions, " token positions exceed the session's limit of ", limit,
        " (spec.data.seq_len ", job->spec().data().seq_len(), " x spec.data.batch_size ",
        std::max<int64_t>(1, job->spec().data().batch_size()), ", the memory the planner checked); split the batch")));
  }
  const std::string worker_id = job->workers_size() > 0 ? job->workers(0) : "";
  auto w = workers_.find(worker_id);
  if (w == workers_.end() || w->second.session == 0) {
    // Not forwarded: the sequence stays free for the retry (mu_ was held since AwaitSequence).
    if (sequence > 0) sequences_[id].next = sequence;
    return finish(absl::UnavailableError(absl::StrCat("job: the worker of ", job->name(), " (", worker_id,
                                                      ") is disconnected; retry once it is back or the job restarts")));
  }
  const int64_t call_id = next_call_id_++;
  call.set_call_id(call_id);
  call.set_job(job->name());
  auto pending = std::make_shared<PendingCall>();
  pending->job = id;
  pending->worker = worker_id;
  pending_calls_[call_id] = pending;
  v1::ControllerMessage message;
  *message.mutable_call() = std::move(call);
  SendTo(worker_id, message);
  // Waits with mu_ released: the reply, the worker's stream ending or the job ending sets done.
  bool client_gone = false;
  while (!pending->done) {
    mu_.AwaitWithTimeout(absl::Condition(&pending->done), absl::Seconds(1));
    if (!pending->done && cancelled && cancelled()) {
      client_gone = true;
      break;
    }
  }
  pending_calls_.erase(call_id);
  if (client_gone) {
    return finish(absl::CancelledError("the client cancelled the call; it may still run on the session's worker"));
  }
  if (!pending->status.ok()) return finish(pending->status);
  if (pending->reply.code() != 0) {
    return finish(absl::Status(static_cast<absl::StatusCode>(pending->reply.code()), pending->reply.message()));
  }
  return finish(std::move(pending->reply));
}

void Controller::OnReply(Worker& w, const v1::TrainingReply& reply) {
  auto it = pending_calls_.find(reply.call_id());
  if (it == pending_calls_.end() || it->second->worker != w.id || it->second->done) return;  // failed already
  PendingCall& pending = *it->second;
  pending.reply = reply;
  pending.done = true;
  if (!pending.part) ApplyReply(pending.job, reply);
}

void Controller::ApplyReply(int64_t id, const v1::TrainingReply& reply) {
  v1::Job* job = FindJob(id);
  if (reply.code() != 0 || !job) return;
  switch (reply.reply_case()) {
    case v1::TrainingReply::kForwardBackward: {
      const v1::ForwardBackwardResponse& fb = reply.forward_backward();
      job->set_loss(fb.loss());  // the whole batch's (OnProgress keeps it)
      if (fb.tokens() > 0) metrics_.AddTokens(fb.tokens());
      if (fb.mismatch_tokens() > 0) metrics_.SetMismatch(job->name(), fb.mismatch_mean(), fb.mismatch_max());
      break;
    }
    case v1::TrainingReply::kOptimStep:
      metrics_.SetOptimizerStep(job->name(), reply.optim_step().step());
      break;
    case v1::TrainingReply::kLoadCheckpoint:
      metrics_.SetOptimizerStep(job->name(), reply.load_checkpoint().step());
      break;
    case v1::TrainingReply::kSaveCheckpoint: {
      // What a restart after a worker loss resumes from.
      const v1::SaveCheckpointResponse& save = reply.save_checkpoint();
      job->set_last_checkpoint(save.directory());
      if (absl::Status s = store_->AddCheckpoint(id, save.step(), save.directory()); !s.ok()) {
        spdlog::error("job={} store checkpoint failed: {}", job->name(), s.ToString());
      }
      spdlog::info("job={} checkpoint step={} dir={}", job->name(), save.step(), save.directory());
      v1::JobEvent ckpt;
      ckpt.set_checkpoint(save.directory());
      Commit(id, ckpt);
      break;
    }
    default:
      break;
  }
}

absl::StatusOr<v1::TrainingReply> Controller::TrainRanks(int64_t id, v1::TrainingCall call, int64_t sequence,
                                                         const std::function<bool()>& cancelled) {
  const v1::Job& job = *FindJob(id);
  const v1::TrainingCall::CallCase kind = call.call_case();
  // The ranks this call goes to, with their calls (rank order).
  absl::StatusOr<std::vector<RankCall>> split = SplitCall(std::move(call), job.workers_size(), job.spec());
  if (!split.ok()) return split.status();
  std::vector<RankCall>& targets = *split;
  for (const auto& [rank, rc] : targets) {
    auto w = workers_.find(job.workers(rank));
    if (w == workers_.end() || w->second.session == 0) {
      // Not forwarded to any rank: the sequence stays free for the retry.
      if (sequence > 0) sequences_[id].next = sequence;
      return absl::UnavailableError(absl::StrCat("job: the worker of rank ", rank, " of ", job.name(), " (",
                                                 job.workers(rank),
                                                 ") is disconnected; retry once it is back or the job restarts"));
    }
  }
  // Every rank's message is handed to its stream here, in one section under mu_: the ranks'
  // FIFOs see the session's calls in the same order, which the engine's collectives rely on.
  std::vector<int64_t> call_ids;
  std::vector<std::shared_ptr<PendingCall>> pendings;
  for (auto& [rank, rc] : targets) {
    const int64_t call_id = next_call_id_++;
    rc.set_call_id(call_id);
    rc.set_job(job.name());
    auto pending = std::make_shared<PendingCall>();
    pending->job = id;
    pending->worker = job.workers(rank);
    pending->part = true;
    pending_calls_[call_id] = pending;
    call_ids.push_back(call_id);
    pendings.push_back(pending);
    v1::ControllerMessage message;
    *message.mutable_call() = std::move(rc);
    SendTo(pending->worker, message);
  }
  // Waits with mu_ released for every reply, or for a rank failing without one (its stream
  // ended, the job ended): then the others' replies no longer matter.
  auto settled = [&pendings]() {
    bool all = true;
    for (const auto& p : pendings) {
      if (p->done && !p->status.ok()) return true;
      all = all && p->done;
    }
    return all;
  };
  bool client_gone = false;
  while (!settled()) {
    mu_.AwaitWithTimeout(absl::Condition(&settled), absl::Seconds(1));
    if (!settled() && cancelled && cancelled()) {
      client_gone = true;
      break;
    }
  }
  for (int64_t call_id : call_ids) pending_calls_.erase(call_id);
  if (client_gone) {
    return absl::CancelledError("the client cancelled the call; it may still run on the session's workers");
  }
  std::vector<v1::TrainingReply> replies;
  for (const auto& p : pendings) {
    if (p->done && !p->status.ok()) return p->status;
    replies.push_back(std::move(p->reply));
  }
  absl::StatusOr<v1::TrainingReply> merged = MergeReplies(kind, std::move(replies));
  if (!merged.ok()) return merged.status();
  ApplyReply(id, *merged);
  return merged;
}

void Controller::FailPendingCalls(int64_t id, const std::string& worker_id, const absl::Status& status) {
  for (auto& [call_id, pending] : pending_calls_) {
    if (pending->done || (id != 0 && pending->job != id) || (!worker_id.empty() && pending->worker != worker_id)) continue;
    pending->status = status;
    pending->done = true;
  }
}

int Controller::WaitingCalls(int64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(id);
  return it == sequences_.end() ? 0 : static_cast<int>(it->second.waiting.size());
}

std::vector<WorkerInfo> Controller::Workers() {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerInfo> out;
  for (const auto& [id, w] : workers_) {
    out.push_back({id, w.session != 0, w.job ? JobName(w.job) : ""});
  }
  return out;
}

}  // namespace odyssey::server
