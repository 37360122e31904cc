// Test support for the Controller's unit tests (controller_test, workers_test, scheduler_test,
// planning_test, session_router_test, session_ranks_test): a fixture owning a Controller over a
// fresh SQLite store with a fake clock and a Prometheus registry, and recording worker
// connections. Header-only; each test binary includes it once.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "odyssey/v1/odyssey.pb.h"
#include "prometheus/registry.h"
#include "server/auth.h"
#include "server/controller.h"
#include "server/job_store.h"
#include "server/paths.h"
#include "server/validation.h"

namespace odyssey::server::testing {

namespace v1 = odyssey::v1;

// Callers of these tests are the anonymous tenant (auth off), except in the tenant tests.
inline const std::string kAnon = kAnonymousTenant;

// Attaches a worker as a fresh worker process does: hello, then an empty `held` (the
// controller assigns nothing to a worker before its `held` is read).
inline absl::StatusOr<int64_t> AttachFresh(Controller* controller, const v1::WorkerCapabilities& caps,
                                           const std::string& host, std::shared_ptr<WorkerConnection> conn) {
  absl::StatusOr<int64_t> session = controller->AttachWorker(caps, host, std::move(conn));
  if (!session.ok()) return session;
  v1::WorkerMessage held;
  held.mutable_held();
  controller->OnWorkerMessage(*session, held);
  return session;
}

// Records what the controller sends to one worker.
class FakeConnection : public WorkerConnection {
 public:
  void Send(const v1::ControllerMessage& m) override { sent.push_back(m); }
  void Close() override { closed = true; }
  std::vector<v1::Assignment> Assignments() const {
    std::vector<v1::Assignment> out;
    for (const auto& m : sent) {
      if (m.has_assign()) out.push_back(m.assign());
    }
    return out;
  }
  int Count(v1::ControllerMessage::MsgCase c) const {
    int n = 0;
    for (const auto& m : sent) n += m.msg_case() == c;
    return n;
  }
  std::vector<v1::ControllerMessage> sent;
  bool closed = false;
};

class ControllerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("odyssey_controller_test_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    Restart();
  }
  void TearDown() override {
    controller_.reset();
    std::filesystem::remove_all(dir_);
  }
  // (Re)creates the controller over the same store, as a process restart does.
  void Restart() {
    controller_.reset();
    auto store = JobStore::Open((dir_ / "c.db").string());
    ASSERT_TRUE(store.ok());
    ControllerOptions options;
    options.heartbeat_timeout = absl::Seconds(10);
    options.checkpoint_root = (dir_ / "ckpt").string();
    options.clock = [this] { return now_; };
    registry_ = std::make_shared<prometheus::Registry>();
    options.registry = registry_;
    options.sequence_wait = sequence_wait_;
    options.paths = paths_;
    auto c = Controller::Create(options, std::move(*store));
    ASSERT_TRUE(c.ok()) << c.status();
    controller_ = std::move(*c);
  }

  static v1::CreateJobRequest Request(int world, int steps = 10, const std::string& rid = "", int priority = 0,
                                      int restart_limit = 0) {
    v1::CreateJobRequest r;
    r.set_request_id(rid);
    auto* s = r.mutable_spec();
    s->mutable_model()->set_name("tiny");
    s->mutable_optimizer()->set_lr(1e-3);
    s->mutable_data()->set_seq_len(64);
    s->mutable_data()->set_batch_size(1);
    s->mutable_parallel()->set_world_size(world);
    s->set_steps(steps);
    s->set_priority(priority);
    s->set_restart_limit(restart_limit);
    return r;
  }

  struct Attached {
    std::shared_ptr<FakeConnection> conn;
    int64_t session;
  };
  // A fresh worker (hello, empty held); with send_held = false a returning one, whose test
  // sends its `held`.
  Attached Attach(const std::string& id, const std::string& host = "127.0.0.1", bool send_held = true) {
    v1::WorkerCapabilities caps;
    caps.set_worker_id(id);
    caps.set_device("cpu");
    auto conn = std::make_shared<FakeConnection>();
    auto session = send_held ? AttachFresh(controller_.get(), caps, host, conn)
                             : controller_->AttachWorker(caps, host, conn);
    EXPECT_TRUE(session.ok()) << session.status();
    return {conn, session.ok() ? *session : 0};
  }
  void Progress(const Attached& w, const std::string& job, int rank, int64_t step, const std::string& ckpt = "") {
    v1::WorkerMessage m;
    m.mutable_progress()->set_job(job);
    m.mutable_progress()->set_rank(rank);
    m.mutable_progress()->mutable_metrics()->set_step(step);
    m.mutable_progress()->mutable_metrics()->set_loss(1.0 / step);
    m.mutable_progress()->mutable_metrics()->set_tokens(100);
    m.mutable_progress()->set_checkpoint(ckpt);
    controller_->OnWorkerMessage(w.session, m);
  }
  void Result(const Attached& w, const std::string& job, int rank, bool ok, const std::string& cancelled = "") {
    v1::WorkerMessage m;
    m.mutable_result()->set_job(job);
    m.mutable_result()->set_rank(rank);
    m.mutable_result()->set_ok(ok);
    m.mutable_result()->set_error(ok ? "" : "boom");
    m.mutable_result()->set_cancelled(cancelled);
    controller_->OnWorkerMessage(w.session, m);
  }
  v1::Job Get(const std::string& name) { return *controller_->GetJob(*ParseJobName(name), kAnon); }

  std::filesystem::path dir_;
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
  std::unique_ptr<Controller> controller_;
  std::shared_ptr<prometheus::Registry> registry_;
  absl::Duration sequence_wait_ = absl::Seconds(30);
  PathPolicy paths_;  // off unless a test confines paths
};

// Records what the controller sends to one worker; thread-safe (Train sends from the threads
// that call it).
class CallConnection : public WorkerConnection {
 public:
  void Send(const v1::ControllerMessage& m) override {
    absl::MutexLock l(&mu_);
    sent_.push_back(m);
  }
  void Close() override {}
  // The TrainingCalls sent so far, once there are at least `n` (waits up to 10 s).
  std::vector<v1::TrainingCall> WaitForCalls(size_t n) {
    absl::MutexLock l(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return Calls().size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
    return Calls();
  }

 private:
  std::vector<v1::TrainingCall> Calls() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<v1::TrainingCall> out;
    for (const auto& m : sent_)
      if (m.has_call()) out.push_back(m.call());
    return out;
  }
  absl::Mutex mu_;
  std::vector<v1::ControllerMessage> sent_ ABSL_GUARDED_BY(mu_);
};

// One Train() running on its own thread.
class AsyncTrain {
 public:
  AsyncTrain(Controller* c, int64_t id, v1::TrainingCall call, int64_t sequence)
      : thread_([=, this] {
          result_ = c->Train(id, call, sequence);
          done_.Notify();
        }) {}
  ~AsyncTrain() { thread_.join(); }
  // The result, waiting up to 10 s (a hang fails the test instead of blocking it).
  absl::StatusOr<v1::TrainingReply> Wait() {
    if (!done_.WaitForNotificationWithTimeout(absl::Seconds(10))) return absl::DeadlineExceededError("Train hung");
    return result_;
  }
  bool done() const { return done_.HasBeenNotified(); }

 private:
  absl::StatusOr<v1::TrainingReply> result_;
  absl::Notification done_;
  std::thread thread_;
};

}  // namespace odyssey::server::testing
