#include "worker/worker.h"

#include <atomic>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/wire_proto.h"
#include "odyssey/v1/odyssey.grpc.pb.h"
#include "worker/rl_calls.h"
#include "worker/worker_metrics.h"

namespace odyssey::worker {
namespace v1 = odyssey::v1;

Worker::Worker(WorkerOptions options, WorkerMetrics* metrics) : options_(std::move(options)), metrics_(metrics) {}

Worker::~Worker() {
  Shutdown();
  std::unique_ptr<JobRunner> runner;
  std::vector<std::unique_ptr<JobRunner>> finished;
  {
    absl::MutexLock lock(&mu_);
    runner = std::move(runner_);
    finished = std::move(finished_runners_);
  }
  // Destroyed outside mu_: a runner's last callback takes mu_.
}

void Worker::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return;
  shutdown_ = true;
  if (runner_ && !running_job_.empty()) runner_->Cancel(kLeavingReason);
}

void Worker::Post(v1::WorkerMessage message) {
  absl::MutexLock lock(&mu_);
  if (connected_ && !stream_broken_) outbox_.push_back(std::move(message));
}

void Worker::OnResult(const v1::JobResult& finished) {
  v1::JobResult result = finished;
  // Stopped because this worker leaves: the job is not at fault (the controller restarts it).
  if (!result.ok() && result.cancelled() == kLeavingReason) result.set_worker_leaving(true);
  absl::MutexLock lock(&mu_);
  unreleased_[result.job()] = result;
  if (running_job_ == result.job()) running_job_.clear();
  if (connected_ && !stream_broken_) {
    v1::WorkerMessage m;
    *m.mutable_result() = result;
    outbox_.push_back(std::move(m));
  }
}

void Worker::Handle(const v1::ControllerMessage& message) {
  std::vector<std::unique_ptr<JobRunner>> to_join;
  {
    absl::MutexLock lock(&mu_);
    switch (message.msg_case()) {
      case v1::ControllerMessage::kAssign: {
        const v1::Assignment& a = message.assign();
        if (running_job_ == a.job()) break;  // a repeated assignment of what already runs
        if (!running_job_.empty() || shutdown_) {
          v1::JobResult busy;
          busy.set_job(a.job());
          busy.set_rank(a.rank());
          busy.set_ok(false);
          busy.set_error(shutdown_ ? absl::StrCat("worker ", options_.capabilities.worker_id(), " is shutting down")
                                   : absl::StrCat("worker ", options_.capabilities.worker_id(), " is busy with ",
                                                  running_job_));
          busy.set_worker_leaving(shutdown_);
          v1::WorkerMessage m;
          *m.mutable_result() = busy;
          outbox_.push_back(std::move(m));
          break;
        }
        LogInfo(absl::StrCat("worker=", options_.capabilities.worker_id(), " job=", a.job(), " assigned: rank ",
                             a.rank(), "/", a.world_size(), a.resume_from().empty() ? "" : " resume_from=",
                             a.resume_from(), " checkpoint_dir=", a.checkpoint_dir()));
        if (runner_) finished_runners_.push_back(std::move(runner_));
        running_job_ = a.job();
        unreleased_.erase(a.job());
        JobCallbacks callbacks;
        callbacks.progress = [this](const v1::JobProgress& p) {
          v1::WorkerMessage m;
          *m.mutable_progress() = p;
          Post(std::move(m));
        };
        callbacks.reply = [this](const v1::TrainingReply& r) {
          v1::WorkerMessage m;
          *m.mutable_reply() = r;
          Post(std::move(m));
        };
        callbacks.done = [this](const v1::JobResult& r) { OnResult(r); };
        runner_ = std::make_unique<JobRunner>(a, options_.runner, std::move(callbacks), metrics_);
        break;
      }
      case v1::ControllerMessage::kCancel:
        if (runner_ && running_job_ == message.cancel()) {
          LogInfo(absl::StrCat("worker=", options_.capabilities.worker_id(), " job=", message.cancel(), " cancel"));
          runner_->Cancel("cancelled by the controller");
        }
        break;
      case v1::ControllerMessage::kRelease:
        unreleased_.erase(message.release());
        break;
      case v1::ControllerMessage::kCall: {
        const v1::TrainingCall& call = message.call();
        if (runner_ && running_job_ == call.job() && runner_->Submit(call)) break;
        v1::WorkerMessage m;
        *m.mutable_reply() = ErrorReply(
            call, absl::FailedPreconditionError(absl::StrCat("job: worker ", options_.capabilities.worker_id(),
                                                             " runs no RL session for ", call.job(),
                                                             " (it ended, or the job is not an RL_SESSION)")));
        if (connected_ && !stream_broken_) outbox_.push_back(std::move(m));
        break;
      }
      default:
        break;
    }
    to_join = std::move(finished_runners_);
    finished_runners_.clear();
  }
  // Ended runners are joined outside mu_ (their last callback may still be taking it).
}

bool Worker::LogRefusal(const std::string& id, const grpc::Status& status) const {
  const grpc::StatusCode code = status.error_code();
  if (code == grpc::StatusCode::ALREADY_EXISTS) {
    // Another stream holds this id: retried with backoff (it may be this worker's own old
    // stream, which the controller drops once it notices).
    LogError(absl::StrCat("worker=", id, " refused by the controller at ", options_.controller,
                          " (ALREADY_EXISTS): ", status.error_message()));
    return true;
  }
  if (code != grpc::StatusCode::UNAUTHENTICATED && code != grpc::StatusCode::PERMISSION_DENIED) return false;
  LogError(absl::StrCat("worker=", id, " refused by the controller at ", options_.controller, " (",
                        code == grpc::StatusCode::UNAUTHENTICATED ? "UNAUTHENTICATED" : "PERMISSION_DENIED",
                        "): ", status.error_message(), "; check --token-file (a token of tenant @worker)"));
  return true;
}

bool Worker::Serve() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options_.max_message_bytes);
  args.SetMaxSendMessageSize(options_.max_message_bytes);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  const std::string& id = options_.capabilities.worker_id();
  // Read on every connect: rotated certificates and tokens apply without a restart.
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = MakeChannelCredentials(options_.tls, &args);
  if (!credentials.ok()) {
    LogError(absl::StrCat("worker=", id, " cannot connect: ", credentials.status().message()));
    return false;
  }
  std::string token;
  if (!options_.token_file.empty()) {
    absl::StatusOr<std::string> read = ReadTokenFile(options_.token_file, "--token-file");
    if (!read.ok()) {
      LogError(absl::StrCat("worker=", id, " cannot connect: ", read.status().message()));
      return false;
    }
    token = *std::move(read);
  }
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(options_.controller, *credentials, args);
  std::unique_ptr<v1::WorkerService::Stub> stub = v1::WorkerService::NewStub(channel);
  grpc::ClientContext ctx;
  AddBearerToken(token, &ctx);
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::ControllerMessage>> stream = stub->Attach(&ctx);
  const absl::Time started = absl::Now();

  v1::WorkerMessage hello;
  *hello.mutable_hello() = options_.capabilities;
  if (!stream->Write(hello)) {
    grpc::Status s = stream->Finish();
    if (!LogRefusal(id, s)) {
      LogWarning(absl::StrCat("worker=", id, " cannot attach to ", options_.controller, ": ", s.error_message()));
    }
    return false;
  }
  {
    absl::MutexLock lock(&mu_);
    outbox_.clear();
    v1::WorkerMessage held;
    held.mutable_held();  // sent even when empty: it tells the controller what this worker lost
    if (!running_job_.empty()) held.mutable_held()->add_jobs(running_job_);
    for (const auto& [job, result] : unreleased_) held.mutable_held()->add_jobs(job);
    outbox_.push_back(held);
    for (const auto& [job, result] : unreleased_) {
      v1::WorkerMessage m;
      *m.mutable_result() = result;
      outbox_.push_back(std::move(m));
    }
    connected_ = true;
    stream_broken_ = false;
    LogInfo(absl::StrCat("worker=", id, " attached to ", options_.controller, " holding ",
                         held.held().jobs_size(), " job(s)"));
  }
  if (metrics_) metrics_->connected->Set(1);

  std::atomic<bool> answered{false};
  std::thread reader([&] {
    v1::ControllerMessage m;
    while (stream->Read(&m)) {
      answered = true;
      Handle(m);
    }
    absl::MutexLock lock(&mu_);
    stream_broken_ = true;
  });

  absl::Time next_heartbeat = absl::Now() + options_.heartbeat_interval;
  for (;;) {
    std::deque<v1::WorkerMessage> batch;
    bool heartbeat = false, done = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !outbox_.empty() || stream_broken_ || (shutdown_ && running_job_.empty());
      };
      mu_.AwaitWithDeadline(absl::Condition(&ready), next_heartbeat);
      batch.swap(outbox_);
      if (stream_broken_) done = true;
      // Shutting down: leave once the cancelled job's result is on its way.
      if (shutdown_ && running_job_.empty() && batch.empty()) done = true;
      if (absl::Now() >= next_heartbeat) heartbeat = true;
    }
    if (done) break;
    if (heartbeat) {
      v1::WorkerMessage hb;
      const absl::Time now = absl::Now();
      hb.mutable_heartbeat()->mutable_time()->set_seconds(absl::ToUnixSeconds(now));
      batch.push_back(std::move(hb));
      next_heartbeat = now + options_.heartbeat_interval;
    }
    bool ok = true;
    for (v1::WorkerMessage& m : batch) {
      // A string that is not UTF-8 (a job's error quoting a dataset's bytes) would make the
      // controller's parser drop the whole stream, on every attempt to report it.
      if (MakeWireSafe(&m) > 0) LogWarning(absl::StrCat("worker=", id, " escaped non-UTF-8 text in a message"));
      if (!stream->Write(m)) {
        ok = false;
        break;
      }
    }
    if (!ok) break;
  }
  bool controller_ended;
  {
    absl::MutexLock lock(&mu_);
    connected_ = false;
    outbox_.clear();
    controller_ended = stream_broken_;
  }
  if (metrics_) metrics_->connected->Set(0);
  stream->WritesDone();
  // When the controller ended the call, Finish() reports its status (e.g. a refused token);
  // cancelling first would replace that with CANCELLED. Otherwise (shutting down) the half-close
  // lets the controller read what was written, the cancelled job's result last, and end the
  // call: a cancel sent at once could overtake those messages and the job would be handled as
  // a lost worker's. The wait is bounded, so a controller that does not answer cannot hold the
  // shutdown.
  if (!controller_ended) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stream_broken_), absl::Seconds(5));
    controller_ended = stream_broken_;
  }
  if (!controller_ended) ctx.TryCancel();
  reader.join();
  grpc::Status s = stream->Finish();
  bool shutting_down;
  {
    absl::MutexLock lock(&mu_);
    shutting_down = shutdown_;
  }
  if (!LogRefusal(id, s) && !shutting_down) {
    LogWarning(absl::StrCat("worker=", id, " lost the controller at ", options_.controller, ": ",
                            s.ok() ? "stream ended" : s.error_message()));
  }
  return answered || absl::Now() - started > absl::Seconds(2);
}

absl::Status Worker::Run() {
  absl::Duration backoff = options_.initial_backoff;
  bool first = true;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) break;
    }
    if (!first && metrics_) metrics_->reconnects->Increment();
    first = false;
    if (Serve()) backoff = options_.initial_backoff;
    absl::MutexLock lock(&mu_);
    if (shutdown_) break;
    // Backoff before the next attempt; a shutdown ends the wait at once.
    mu_.AwaitWithTimeout(absl::Condition(&shutdown_), backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  std::unique_ptr<JobRunner> runner;
  {
    absl::MutexLock lock(&mu_);
    runner = std::move(runner_);
  }
  runner.reset();  // cancels and joins
  return absl::OkStatus();
}

}  // namespace odyssey::worker
