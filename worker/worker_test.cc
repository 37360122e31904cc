// The worker's side of the Attach protocol, against a scripted fake controller in-process:
// hello then held on every stream, a busy worker refuses a second job, cancel stops a run, a
// result is re-sent on every new stream until released, and reconnects follow a dropped stream.
#include "worker/worker.h"

#include <cstdio>
#include <deque>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "odyssey/v1/odyssey.grpc.pb.h"

namespace odyssey::worker {
namespace {
namespace v1 = odyssey::v1;

// Records what workers send, stream by stream, and sends what the test queues.
class FakeController final : public v1::WorkerService::Service {
 public:
  grpc::Status Attach(grpc::ServerContext* context,
                      grpc::ServerReaderWriter<v1::ControllerMessage, v1::WorkerMessage>* stream) override {
    int index;
    {
      absl::MutexLock l(&mu_);
      index = static_cast<int>(streams_.size());
      streams_.emplace_back();
      contexts_.push_back(context);
    }
    std::thread writer([&] {
      for (;;) {
        v1::ControllerMessage m;
        {
          absl::MutexLock l(&mu_);
          auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
            return !outbox_.empty() || contexts_[index] == nullptr;
          };
          mu_.Await(absl::Condition(&ready));
          if (contexts_[index] == nullptr) return;
          m = outbox_.front();
          outbox_.pop_front();
        }
        stream->Write(m);
      }
    });
    v1::WorkerMessage m;
    while (stream->Read(&m)) {
      absl::MutexLock l(&mu_);
      if (m.has_heartbeat()) {
        heartbeats_.push_back(absl::Now());
      } else {
        streams_[index].push_back(m);
      }
    }
    {
      absl::MutexLock l(&mu_);
      contexts_[index] = nullptr;
    }
    writer.join();
    return grpc::Status::OK;
  }

  void Send(v1::ControllerMessage m) {
    absl::MutexLock l(&mu_);
    outbox_.push_back(std::move(m));
  }
  // Ends the newest stream from the controller's side (as a controller restart would).
  void DropStream() {
    absl::MutexLock l(&mu_);
    if (!contexts_.empty() && contexts_.back()) contexts_.back()->TryCancel();
  }
  // Waits until stream `index` holds a message satisfying `pred`; returns it.
  std::optional<v1::WorkerMessage> WaitFor(int index, const std::function<bool(const v1::WorkerMessage&)>& pred,
                                           absl::Duration timeout = absl::Seconds(10)) {
    absl::MutexLock l(&mu_);
    std::optional<v1::WorkerMessage> found;
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (static_cast<int>(streams_.size()) <= index) return false;
      for (const auto& m : streams_[index])
        if (pred(m)) {
          found = m;
          return true;
        }
      return false;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&cond), timeout)) {
      ADD_FAILURE() << "stream " << index << " of " << streams_.size() << " has "
                    << (static_cast<int>(streams_.size()) > index ? streams_[index].size() : 0) << " messages";
    }
    return found;
  }
  std::vector<v1::WorkerMessage> Stream(int index) {
    absl::MutexLock l(&mu_);
    return streams_.at(index);
  }
  // When each heartbeat arrived, once there are at least `n` (waits up to `timeout`).
  std::vector<absl::Time> Heartbeats(size_t n, absl::Duration timeout) {
    absl::MutexLock l(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return heartbeats_.size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
    return heartbeats_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::vector<v1::WorkerMessage>> streams_ ABSL_GUARDED_BY(mu_);
  std::vector<grpc::ServerContext*> contexts_ ABSL_GUARDED_BY(mu_);  // null once the stream ended
  std::deque<v1::ControllerMessage> outbox_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Time> heartbeats_ ABSL_GUARDED_BY(mu_);  // arrival times, every stream
};

v1::ControllerMessage Assign(const std::string& job, int64_t steps) {
  v1::ControllerMessage m;
  v1::Assignment* a = m.mutable_assign();
  a->set_job(job);
  a->set_world_size(1);
  v1::JobSpec* s = a->mutable_spec();
  s->mutable_model()->set_name("tiny");
  s->mutable_model()->set_dtype("float32");
  s->mutable_optimizer()->set_lr(1e-3);
  s->mutable_data()->set_format("kjv");
  s->mutable_data()->set_seq_len(16);
  s->mutable_data()->set_batch_size(1);
  s->set_steps(steps);
  return m;
}

// Serves `fake` on a loopback port picked at run time (written to *port).
std::unique_ptr<grpc::Server> Serve(FakeController* fake, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.RegisterService(fake);
  return builder.BuildAndStart();
}

// A CPU worker `id` attaching to the fake on `port`.
WorkerOptions CpuWorker(const std::string& id, int port) {
  WorkerOptions o;
  o.controller = "127.0.0.1:" + std::to_string(port);
  o.capabilities.set_worker_id(id);
  o.capabilities.set_device("cpu");
  o.runner.device = "cpu";
  return o;
}

auto IsResult(const std::string& job) {
  return [job](const v1::WorkerMessage& m) { return m.has_result() && m.result().job() == job; };
}
auto IsProgress(const std::string& job) {
  return [job](const v1::WorkerMessage& m) { return m.has_progress() && m.progress().job() == job; };
}

TEST(WorkerTest, AttachProtocol) {
  SetTorchThreads(1);
  FakeController fake;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&fake, &port);
  ASSERT_NE(port, 0);
  WorkerOptions o = CpuWorker("t1", port);
  o.heartbeat_interval = absl::Milliseconds(50);
  o.initial_backoff = absl::Milliseconds(10);
  o.max_backoff = absl::Milliseconds(100);
  Worker worker(o, nullptr);
  std::thread run([&] { EXPECT_TRUE(worker.Run().ok()); });

  // Every stream opens with hello, then held (empty on a fresh start).
  ASSERT_TRUE(fake.WaitFor(0, [](const v1::WorkerMessage& m) { return m.has_held(); }));
  std::vector<v1::WorkerMessage> first = fake.Stream(0);
  ASSERT_GE(first.size(), 2u);
  EXPECT_EQ(first[0].hello().worker_id(), "t1");
  EXPECT_EQ(first[1].held().jobs_size(), 0);

  // A running job; a second assignment is refused naming the first.
  fake.Send(Assign("jobs/1", 1000000));
  ASSERT_TRUE(fake.WaitFor(0, IsProgress("jobs/1")));
  fake.Send(Assign("jobs/2", 10));
  auto busy = fake.WaitFor(0, IsResult("jobs/2"));
  ASSERT_TRUE(busy);
  EXPECT_FALSE(busy->result().ok());
  EXPECT_TRUE(absl::StrContains(busy->result().error(), "busy with jobs/1")) << busy->result().error();

  // Cancel stops it between steps.
  v1::ControllerMessage cancel;
  cancel.set_cancel("jobs/1");
  fake.Send(cancel);
  auto cancelled = fake.WaitFor(0, IsResult("jobs/1"));
  ASSERT_TRUE(cancelled);
  EXPECT_EQ(cancelled->result().cancelled(), "cancelled by the controller");
  EXPECT_FALSE(cancelled->result().worker_leaving());
  EXPECT_FALSE(busy->result().worker_leaving());

  // The controller goes away before releasing it: the next stream holds the job and re-sends
  // its result.
  fake.DropStream();
  ASSERT_TRUE(fake.WaitFor(1, IsResult("jobs/1")));
  std::vector<v1::WorkerMessage> second = fake.Stream(1);
  EXPECT_TRUE(second[0].has_hello());
  ASSERT_TRUE(second[1].has_held());
  ASSERT_EQ(second[1].held().jobs_size(), 1);
  EXPECT_EQ(second[1].held().jobs(0), "jobs/1");

  // Released; the worker is idle again and runs the next job to the end.
  v1::ControllerMessage release;
  release.set_release("jobs/1");
  fake.Send(release);
  fake.Send(Assign("jobs/3", 3));  // on the same stream, after the release
  auto done = fake.WaitFor(1, IsResult("jobs/3"));
  ASSERT_TRUE(done);
  EXPECT_TRUE(done->result().ok()) << done->result().error();
  EXPECT_EQ(done->result().step(), 3);
  // jobs/3 is not released: after a drop, the next stream holds it (and only it: the release
  // of jobs/1 was read before jobs/3 was assigned on the same stream).
  fake.DropStream();
  ASSERT_TRUE(fake.WaitFor(2, IsResult("jobs/3")));
  std::vector<v1::WorkerMessage> third = fake.Stream(2);
  ASSERT_GE(third.size(), 2u);
  ASSERT_EQ(third[1].held().jobs_size(), 1);
  EXPECT_EQ(third[1].held().jobs(0), "jobs/3");

  worker.Shutdown();
  run.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// Shutdown (the worker's SIGTERM) stops the running job between steps and reports it as the
// worker leaving, not as the job's failure or a cancel of the job, before Run returns.
TEST(WorkerTest, ShutdownReportsTheStoppedRunAsTheWorkerLeaving) {
  SetTorchThreads(1);
  FakeController fake;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&fake, &port);
  ASSERT_NE(port, 0);
  Worker worker(CpuWorker("bye", port), nullptr);
  std::thread run([&] { EXPECT_TRUE(worker.Run().ok()); });
  ASSERT_TRUE(fake.WaitFor(0, [](const v1::WorkerMessage& m) { return m.has_held(); }));
  fake.Send(Assign("jobs/1", 1000000));
  ASSERT_TRUE(fake.WaitFor(0, IsProgress("jobs/1")));
  worker.Shutdown();
  run.join();  // Run returns once the result went out and the stream closed
  std::optional<v1::WorkerMessage> stopped = fake.WaitFor(0, IsResult("jobs/1"), absl::ZeroDuration());
  ASSERT_TRUE(stopped) << "the result did not reach the controller before Run returned";
  EXPECT_FALSE(stopped->result().ok());
  EXPECT_EQ(stopped->result().cancelled(), "the worker is shutting down");
  EXPECT_TRUE(stopped->result().worker_leaving());
  EXPECT_GT(stopped->result().step(), 0);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// The protocol asks a worker for a heartbeat at least every heartbeat timeout / 3
// (server/README.md, "Worker protocol"). The defaults keep it: 1 s against the controller's
// 10 s --heartbeat-timeout. And the interval holds while a job trains (the training thread
// never holds up the stream): with a 100 ms interval (a 1 s timeout at the default ratio), no
// gap between heartbeats reaches 333 ms.
TEST(WorkerTest, HeartbeatsAtLeastEveryThirdOfTheTimeoutWhileTraining) {
  EXPECT_LE(WorkerOptions{}.heartbeat_interval * 3, absl::Seconds(10))
      << "the default heartbeat interval must be at most the controller's default --heartbeat-timeout / 3";
  SetTorchThreads(1);
  FakeController fake;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&fake, &port);
  ASSERT_NE(port, 0);
  WorkerOptions o = CpuWorker("hb", port);
  o.runner.progress_interval_seconds = 0;
  o.heartbeat_interval = absl::Milliseconds(100);
  Worker worker(o, nullptr);
  std::thread run([&] { EXPECT_TRUE(worker.Run().ok()); });
  ASSERT_TRUE(fake.WaitFor(0, [](const v1::WorkerMessage& m) { return m.has_held(); }));
  fake.Send(Assign("jobs/1", 1000000));
  ASSERT_TRUE(fake.WaitFor(0, IsProgress("jobs/1")));
  const size_t before = fake.Heartbeats(0, absl::ZeroDuration()).size();
  const std::vector<absl::Time> beats = fake.Heartbeats(before + 15, absl::Seconds(30));
  ASSERT_GE(beats.size(), before + 15) << "15 heartbeats of 100 ms did not come within 30 s";
  absl::Duration worst;
  for (size_t i = before + 1; i < beats.size(); ++i) worst = std::max(worst, beats[i] - beats[i - 1]);
  std::printf("largest gap between heartbeats while training: %s\n", absl::FormatDuration(worst).c_str());
  EXPECT_LT(worst, absl::Milliseconds(333));
  worker.Shutdown();
  run.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// A job whose error is not UTF-8 (a "jsonl" file that is gzip: the parse error quotes byte
// 0x8b, the first byte here) is reported on the same stream, its bytes escaped; the stream survives (the next job
// runs on it), where it used to drop on every attempt to send the result.
TEST(WorkerTest, AnErrorThatIsNotUtf8IsReportedAndTheStreamSurvives) {
  SetTorchThreads(1);
  const std::string path = ::testing::TempDir() + "/gzip-named-jsonl.jsonl";
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    const unsigned char gzip[] = {0x8b, 0x1f, 0x08, 0x00, 0x8b, 0xff, 0x0a};  // first byte 0x8b
    std::fwrite(gzip, 1, sizeof(gzip), f);
    std::fclose(f);
  }
  FakeController fake;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&fake, &port);
  ASSERT_NE(port, 0);
  WorkerOptions o = CpuWorker("t2", port);
  o.heartbeat_interval = absl::Milliseconds(50);
  o.initial_backoff = absl::Milliseconds(10);
  Worker worker(o, nullptr);
  std::thread run([&] { EXPECT_TRUE(worker.Run().ok()); });
  ASSERT_TRUE(fake.WaitFor(0, [](const v1::WorkerMessage& m) { return m.has_held(); }));

  v1::ControllerMessage bad = Assign("jobs/1", 5);
  bad.mutable_assign()->mutable_spec()->mutable_data()->set_format("jsonl");
  bad.mutable_assign()->mutable_spec()->mutable_data()->set_path(path);
  fake.Send(bad);
  auto failed = fake.WaitFor(0, IsResult("jobs/1"));
  ASSERT_TRUE(failed);
  EXPECT_FALSE(failed->result().ok());
  EXPECT_TRUE(absl::StrContains(failed->result().error(), "\\x8b")) << failed->result().error();
  v1::ControllerMessage release;
  release.set_release("jobs/1");
  fake.Send(release);
  fake.Send(Assign("jobs/2", 2));
  auto next = fake.WaitFor(0, IsResult("jobs/2"));  // stream 0: it never dropped
  ASSERT_TRUE(next);
  EXPECT_TRUE(next->result().ok()) << next->result().error();

  worker.Shutdown();
  run.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace
}  // namespace odyssey::worker
