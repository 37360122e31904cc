#include "server/testing/fake_worker.h"

namespace odyssey::server::testing {

namespace v1 = odyssey::v1;

FakeWorker::FakeWorker(const std::string& address, const std::string& worker_id, std::vector<std::string> held,
                       absl::Duration heartbeat)
    : id_(worker_id), heartbeat_(heartbeat) {
  stub_ = v1::WorkerService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  stream_ = stub_->Attach(&context_);
  v1::WorkerMessage hello;
  hello.mutable_hello()->set_worker_id(worker_id);
  hello.mutable_hello()->set_hostname("localhost");
  hello.mutable_hello()->set_device("cpu");
  Send(hello);
  v1::WorkerMessage held_message;
  for (const auto& j : held) held_message.mutable_held()->add_jobs(j);
  held_message.mutable_held();
  Send(held_message);
  reader_ = std::thread([this] { ReadLoop(); });
  heartbeater_ = std::thread([this] { HeartbeatLoop(); });
}

FakeWorker::~FakeWorker() { Close(); }

void FakeWorker::Close() {
  {
    absl::MutexLock lock(&mu_);
    if (closing_) return;
    closing_ = true;
  }
  context_.TryCancel();
  if (heartbeater_.joinable()) heartbeater_.join();
  if (reader_.joinable()) reader_.join();
}

bool FakeWorker::Send(const v1::WorkerMessage& message) {
  absl::MutexLock lock(&write_mu_);
  return stream_->Write(message);
}

bool FakeWorker::Progress(const std::string& job, int rank, int64_t step, int64_t tokens, double loss,
                          const std::string& checkpoint, double step_seconds) {
  v1::WorkerMessage m;
  auto* p = m.mutable_progress();
  p->set_job(job);
  p->set_rank(rank);
  p->mutable_metrics()->set_step(step);
  p->mutable_metrics()->set_loss(loss);
  p->mutable_metrics()->set_tokens(tokens);
  p->mutable_metrics()->set_step_seconds(step_seconds);
  p->mutable_metrics()->set_tokens_per_second(step_seconds > 0 ? tokens / step_seconds : 0);
  p->set_checkpoint(checkpoint);
  return Send(m);
}

bool FakeWorker::Result(const std::string& job, int rank, bool ok, int64_t step, const std::string& cancelled) {
  v1::WorkerMessage m;
  auto* r = m.mutable_result();
  r->set_job(job);
  r->set_rank(rank);
  r->set_ok(ok);
  r->set_step(step);
  r->set_cancelled(cancelled);
  if (!ok && cancelled.empty()) r->set_error("fake failure");
  return Send(m);
}

void FakeWorker::ReadLoop() {
  v1::ControllerMessage message;
  while (stream_->Read(&message)) {
    absl::MutexLock lock(&mu_);
    received_.push_back(message);
  }
  absl::MutexLock lock(&mu_);
  ended_ = true;
}

void FakeWorker::HeartbeatLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closing_ || ended_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), heartbeat_)) return;
    }
    v1::WorkerMessage hb;
    hb.mutable_heartbeat();
    if (!Send(hb)) return;
  }
}

std::optional<v1::ControllerMessage> FakeWorker::WaitFor(const std::function<bool(const v1::ControllerMessage&)>& match,
                                                         absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  std::optional<v1::ControllerMessage> found;
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& m : received_) {
      if (match(m)) {
        found = m;
        return true;
      }
    }
    return ended_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  return found;
}

std::optional<v1::Assignment> FakeWorker::WaitForAssignment(const std::string& job, absl::Duration timeout) {
  auto m = WaitFor([&](const v1::ControllerMessage& m) { return m.has_assign() && m.assign().job() == job; }, timeout);
  if (!m) return std::nullopt;
  return m->assign();
}

std::vector<v1::ControllerMessage> FakeWorker::Received() {
  absl::MutexLock lock(&mu_);
  return received_;
}

std::vector<v1::Assignment> FakeWorker::Assignments() {
  std::vector<v1::Assignment> out;
  for (const auto& m : Received()) {
    if (m.has_assign()) out.push_back(m.assign());
  }
  return out;
}

bool FakeWorker::Ended() {
  absl::MutexLock lock(&mu_);
  return ended_;
}

}  // namespace odyssey::server::testing
