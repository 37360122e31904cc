#include "worker/job_runner.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/wire_text.h"
#include "planner/memory_spec.h"
#include "worker/checkpoint_folder.h"
#include "worker/rl_calls.h"
#include "worker/rl_session.h"
#include "worker/worker_metrics.h"

namespace odyssey::worker {
namespace v1 = odyssey::v1;

absl::StatusOr<EngineJobOptions> AssignmentToEngineOptions(const v1::Assignment& a, const std::string& device) {
  const v1::JobSpec& spec = a.spec();
  const bool rl = spec.kind() == v1::RL_SESSION;
  if (spec.kind() != v1::SFT && spec.kind() != v1::JOB_KIND_UNSPECIFIED && !rl)
    return absl::InvalidArgumentError(absl::StrCat("spec.kind (", static_cast<int>(spec.kind()),
                                                   ") is not supported by this worker: only SFT and RL_SESSION"));
  if (!rl && spec.steps() <= 0)
    return absl::InvalidArgumentError(absl::StrCat("spec.steps (", spec.steps(), ") must be > 0"));
  EngineJobOptions o;
  o.job = a.job();
  o.model = spec.model().name().empty() ? "tiny" : spec.model().name();
  o.device = device;
  o.dtype = spec.model().dtype().empty() ? "auto" : spec.model().dtype();
  o.attention = spec.model().attention().empty() ? "auto" : spec.model().attention();
  o.indexer_stage = spec.model().indexer_stage();
  o.steps = spec.steps();
  const v1::OptimizerSpec& opt = spec.optimizer();
  o.lr = opt.lr();
  if (opt.beta1() != 0 || opt.beta2() != 0) {
    o.beta1 = opt.beta1();
    o.beta2 = opt.beta2();
  }
  o.eps = opt.eps() > 0 ? opt.eps() : 1e-8;
  o.weight_decay = opt.weight_decay();
  o.warmup_steps = opt.warmup_steps();
  o.min_lr_ratio = opt.min_lr_ratio();
  o.grad_clip = opt.grad_clip();
  absl::StatusOr<planner::MemoryFields> memory = planner::MemoryFieldsFromProto(spec.memory());
  if (!memory.ok()) return memory.status();
  o.memory = *memory;
  absl::StatusOr<model::LoraConfig> lora = planner::LoraFromProto(spec.lora());
  if (!lora.ok()) return lora.status();
  o.lora = *lora;
  o.data_format = spec.data().format().empty() ? "kjv" : spec.data().format();
  o.data_path = spec.data().path();
  o.seq_len = spec.data().seq_len();
  o.batch_size = spec.data().batch_size() > 0 ? spec.data().batch_size() : 1;
  o.seed = spec.data().seed();
  o.rank = a.rank();
  o.world_size = std::max(1, a.world_size());
  o.context_parallel = std::max(1, spec.parallel().context_parallel());
  o.shard_params = spec.parallel().shard_params();
  if (o.rank < 0 || o.rank >= o.world_size)
    return absl::InvalidArgumentError(absl::StrCat("rank (", o.rank, ") must be in [0, world_size (", o.world_size, "))"));
  o.rendezvous = a.rendezvous();
  // The controller's resume_from (the job's own newest checkpoint, after a worker loss) wins;
  // before the job has one, a run starts from the spec's.
  o.resume_from = a.resume_from().empty() ? spec.resume_from() : a.resume_from();
  o.resume_field = a.resume_from().empty() ? "spec.resume_from" : "resume_from";
  o.checkpoint_dir = a.checkpoint_dir().empty() ? spec.checkpoint().directory() : a.checkpoint_dir();
  o.checkpoint_owner = a.checkpoint_owner().empty() ? a.job() : a.checkpoint_owner();  // an older controller's
  // A restart (the controller's resume_from) takes the job's newest own step folder when it is
  // newer: a run the controller lost may have gone on, and pruned what the controller recorded.
  if (!a.resume_from().empty() && !o.checkpoint_dir.empty())
    o.resume_from = RestartCheckpoint(o.checkpoint_dir, o.checkpoint_owner, a.resume_from());
  o.every_steps = spec.checkpoint().every_steps();
  o.keep = spec.checkpoint().keep();
  o.phase_times = spec.profile().phase_times();
  o.trace_step = spec.profile().trace_step();
  if (rl && o.trace_step != 0)
    return absl::InvalidArgumentError(
        "spec.profile.trace_step is not implemented for RL_SESSION jobs yet: traces are of SFT jobs' steps");
  if (rl) {
    // The session's batches come with its calls and each optim_step carries its AdamW
    // parameters: the trainer's own data source and schedule are never used (random ids need
    // no file; a placeholder lr passes the optimizer's checks). seq_len x batch_size remains
    // the batch the memory is planned for.
    o.data_format = "random";
    o.data_path.clear();
    o.steps = 1;
    if (!(o.lr > 0)) o.lr = 1e-3;
    o.warmup_steps = 0;
  }
  return o;
}

absl::StatusOr<v1::WorkerCapabilities> ProbeCapabilities(const std::string& device) {
  absl::StatusOr<DeviceInfo> d = ProbeDevice(device);
  if (!d.ok()) return d.status();
  v1::WorkerCapabilities caps;
  caps.set_hostname(d->hostname);
  caps.set_device(d->device);
  caps.set_device_name(d->device_name);
  caps.set_device_memory_bytes(d->device_memory_bytes);
  caps.set_host_memory_bytes(d->host_memory_bytes);
  return caps;
}

JobRunner::JobRunner(v1::Assignment assignment, JobRunnerOptions options, JobCallbacks callbacks,
                     WorkerMetrics* metrics)
    : assignment_(std::move(assignment)),
      options_(std::move(options)),
      callbacks_(std::move(callbacks)),
      metrics_(metrics) {
  {
    absl::MutexLock lock(&mu_);
    accepting_calls_ = assignment_.spec().kind() == v1::RL_SESSION;
  }
  thread_ = std::thread([this] { Run(); });
}

bool JobRunner::Submit(const v1::TrainingCall& call) {
  absl::MutexLock lock(&mu_);
  if (!accepting_calls_) return false;
  calls_.push_back(call);
  return true;
}

void JobRunner::RunRl(const EngineJobOptions& options, EngineOutcome* outcome) {
  const std::string& job = assignment_.job();
  const int64_t idle_s = assignment_.spec().rl().idle_timeout_seconds() > 0
                             ? assignment_.spec().rl().idle_timeout_seconds()
                             : int64_t{3600};
  const absl::Duration idle = absl::Seconds(idle_s);
  // A multi-rank session waits for its peers at the rendezvous; a cancel meanwhile ends the wait.
  absl::StatusOr<std::unique_ptr<RlSession>> created =
      RlSession::Create(options, [this] { return cancelled_.load(); });
  if (absl::IsCancelled(created.status()) && cancelled_.load()) {
    outcome->stopped = true;
    return;
  }
  std::unique_ptr<RlSession> session;
  if (!created.ok()) {
    outcome->status = created.status();
  } else {
    session = *std::move(created);
    outcome->step = session->step();
    outcome->last_checkpoint = options.resume_from;
    LogInfo(absl::StrCat("job=", job, " RL session ready: ", session->Describe(), ", idle timeout ", idle_s, " s"));
  }
  double last_loss = 0;     // of the last forward_backward
  int64_t tokens = 0;       // forward_backward positions since the last progress
  double seconds = 0;       // compute time since the last progress
  int64_t gpu_peak = 0;     // the device's peak allocated bytes over the calls since then
  absl::Time idle_since = absl::Now();
  while (session) {
    v1::TrainingCall call;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return cancelled_.load() || !calls_.empty(); };
      mu_.AwaitWithDeadline(absl::Condition(&ready), idle_since + idle);
      if (cancelled_.load()) {
        outcome->stopped = true;
        break;
      }
      if (calls_.empty()) {
        LogInfo(absl::StrCat("job=", job, " RL session idle for ", idle_s, " s: ending it"));
        break;
      }
      call = std::move(calls_.front());
      calls_.pop_front();
    }
    RlRequest request = ToRlRequest(call);
    const auto t0 = std::chrono::steady_clock::now();
    RlResponse response = session->Run(request);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gpu_peak = std::max(gpu_peak, response.gpu_memory_peak_bytes);
    const int64_t host_offload = response.host_offload_bytes;
    if (!response.status.ok()) {
      LogInfo(absl::StrCat("job=", job, " ", CallName(call), " call ", call.call_id(), ": ",
                           response.status.ToString()));
    }
    const bool ok = response.status.ok();
    bool report = false;
    std::string checkpoint;
    if (ok) {
      switch (call.call_case()) {
        case v1::TrainingCall::kForwardBackward:
          last_loss = response.loss;
          tokens += response.tokens;
          if (metrics_) metrics_->tokens->Increment(static_cast<double>(response.tokens));
          break;
        case v1::TrainingCall::kOptimStep:
          if (metrics_) metrics_->steps->Increment();
          report = true;
          break;
        case v1::TrainingCall::kLoadCheckpoint:
          report = true;
          break;
        case v1::TrainingCall::kSaveCheckpoint:
          checkpoint = response.directory;
          outcome->last_checkpoint = checkpoint;
          report = true;
          break;
        default:
          break;
      }
    }
    const double grad_norm = response.grad_norm, lr = response.lr;
    v1::TrainingReply reply = ToTrainingReply(call, std::move(response));
    outcome->step = session->step();
    if (report) {
      v1::JobProgress p;
      p.set_job(job);
      p.set_rank(assignment_.rank());
      p.set_checkpoint(checkpoint);
      v1::StepMetrics* m = p.mutable_metrics();
      m->set_step(session->step());
      m->set_loss(last_loss);
      m->set_grad_norm(grad_norm);
      m->set_lr(lr);
      m->set_tokens(tokens);
      m->set_step_seconds(seconds);
      m->set_tokens_per_second(seconds > 0 ? static_cast<double>(tokens) / seconds : 0);
      m->set_world_size(options.world_size);
      m->set_gpu_memory_peak_bytes(gpu_peak);
      m->set_host_offload_bytes(host_offload);
      if (metrics_) {
        if (call.call_case() == v1::TrainingCall::kOptimStep) metrics_->step_duration->Observe(seconds);
        metrics_->gpu_memory_peak->Set(static_cast<double>(gpu_peak));
        metrics_->host_offload->Set(static_cast<double>(host_offload));
      }
      tokens = 0;
      seconds = 0;
      gpu_peak = 0;
      // Progress before the reply: a client that saw the reply sees the job's step in GetJob
      // once the controller has read the stream up to it.
      if (callbacks_.progress) callbacks_.progress(p);
    }
    if (callbacks_.reply) callbacks_.reply(reply);
    idle_since = absl::Now();
  }
}

JobRunner::~JobRunner() {
  Cancel("worker shutting down");
  if (thread_.joinable()) thread_.join();
}

void JobRunner::Cancel(const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (!cancelled_.load()) cancel_reason_ = why;
  cancelled_.store(true);
}

void JobRunner::Run() {
  const std::string& job = assignment_.job();
  const int rank = assignment_.rank();
  if (metrics_) metrics_->busy->Set(1);
  v1::JobResult result;
  result.set_job(job);
  result.set_rank(rank);
  absl::StatusOr<EngineJobOptions> options = AssignmentToEngineOptions(assignment_, options_.device);
  EngineOutcome outcome;
  if (!options.ok()) {
    outcome.status = options.status();
  } else {
    LogInfo(absl::StrCat("job=", job, " rank=", rank, " starting", options->resume_from.empty() ? "" : " from ",
                         options->resume_from));
  }
  if (options.ok() && assignment_.spec().kind() == v1::RL_SESSION) {
    RunRl(*options, &outcome);
  } else if (options.ok()) {
    auto last_progress = std::chrono::steady_clock::now() - std::chrono::hours(1);  // the run's first step is sent
    const int world_size = options->world_size;
    options->peer_loss_grace = absl::Seconds(options_.peer_loss_grace_seconds);
    outcome = RunEngineJob(
        *options,
        [this](absl::Duration wait) {
          if (wait <= absl::ZeroDuration()) return cancelled_.load();
          absl::MutexLock lock(&mu_);  // Cancel() sets the flag under mu_
          auto cancelled = [this] { return cancelled_.load(); };
          mu_.AwaitWithTimeout(absl::Condition(&cancelled), wait);
          return cancelled_.load();
        },
        [&](const EngineStep& s) {
          if (metrics_) {
            metrics_->step_duration->Observe(s.seconds);
            metrics_->tokens->Increment(static_cast<double>(s.tokens) / world_size);
            metrics_->steps->Increment();
            metrics_->gpu_memory_peak->Set(static_cast<double>(s.gpu_memory_peak_bytes));
            metrics_->host_offload->Set(static_cast<double>(s.host_offload_bytes));
            metrics_->host_memory_peak->Set(static_cast<double>(s.host_memory_peak_bytes));
            if (s.mfu > 0) metrics_->mfu->Set(s.mfu);
            for (const engine::PhaseTime& ph : s.phases) metrics_->phase_seconds->Add({{"phase", ph.kind}}).Set(ph.seconds);
          }
          const auto now = std::chrono::steady_clock::now();
          if (s.checkpoint.empty() && s.trace.empty() && s.step != options->steps &&
              std::chrono::duration<double>(now - last_progress).count() < options_.progress_interval_seconds)
            return;
          last_progress = now;
          v1::JobProgress p;
          p.set_job(job);
          p.set_rank(rank);
          p.set_checkpoint(s.checkpoint);
          v1::StepMetrics* m = p.mutable_metrics();
          m->set_step(s.step);
          m->set_loss(s.loss);
          m->set_grad_norm(s.grad_norm);
          m->set_lr(s.lr);
          m->set_tokens_per_second(s.tokens_per_second);
          m->set_tokens(s.tokens);
          m->set_step_seconds(s.seconds);
          m->set_gpu_memory_peak_bytes(s.gpu_memory_peak_bytes);
          m->set_host_offload_bytes(s.host_offload_bytes);
          m->set_host_memory_peak_bytes(s.host_memory_peak_bytes);
          m->set_world_size(world_size);
          AddPhases(s.phases, m->mutable_phases());
          m->set_trace(s.trace);
          if (callbacks_.progress) callbacks_.progress(p);
        });
  }
  result.set_step(outcome.step);
  result.set_last_checkpoint(outcome.last_checkpoint);
  if (!outcome.status.ok()) {
    result.set_ok(false);
    // The controller gets the part a person reads (common/wire_text.h); the log keeps it all.
    result.set_error(WireText(outcome.status.message()));
    // The ranks did not meet (e.g. the rendezvous port was taken): the controller tries again.
    result.set_rendezvous_failed(RanksDidNotMeet(outcome.status));
    LogWarning(absl::StrCat("job=", job, " rank=", rank, " failed at step ", outcome.step, ": ",
                            ValidUtf8(outcome.status.message())));
    if (metrics_) metrics_->jobs_failed->Increment();
  } else if (outcome.stopped) {
    absl::MutexLock lock(&mu_);
    result.set_ok(false);
    result.set_cancelled(cancel_reason_);
    LogInfo(absl::StrCat("job=", job, " rank=", rank, " stopped at step ", outcome.step, ": ", cancel_reason_));
    if (metrics_) metrics_->jobs_cancelled->Increment();
  } else {
    result.set_ok(true);
    LogInfo(absl::StrCat("job=", job, " rank=", rank, " succeeded at step ", outcome.step,
                         " checkpoint=", outcome.last_checkpoint));
    if (metrics_) metrics_->jobs_succeeded->Increment();
  }
  // RL: no more calls: the ones still queued get ABORTED.
  std::deque<v1::TrainingCall> left;
  {
    absl::MutexLock lock(&mu_);
    accepting_calls_ = false;
    left.swap(calls_);
  }
  const absl::Status ended = absl::AbortedError(
      absl::StrCat(job, ": the RL session ended before the call ran (",
                   !outcome.status.ok() ? std::string(outcome.status.message())
                   : outcome.stopped    ? "cancelled"
                                         : "idle timeout",
                   ")"));
  for (const v1::TrainingCall& call : left) {
    if (callbacks_.reply) callbacks_.reply(ErrorReply(call, ended));
  }
  if (metrics_) metrics_->busy->Set(0);
  done_.store(true);
  if (callbacks_.done) callbacks_.done(result);
}

}  // namespace odyssey::worker
