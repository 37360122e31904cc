// The controller binary under hostile input, end to end (issue: the service under faults and
// hostile input): a second worker with a live worker's id, a 10,000-byte job name, and more open
// streams than the thread cap. Every wait is on a condition with a deadline.
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "odyssey/v1/odyssey.grpc.pb.h"
#include "server/testing/controller_process.h"
#include "server/testing/fake_worker.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;
using ::odyssey::server::testing::ControllerProcess;
using ::odyssey::server::testing::FakeWorker;
using ::testing::HasSubstr;

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

// Threads of process `pid` (/proc/<pid>/status), or -1.
int Threads(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    int n = 0;
    if (absl::StartsWith(line, "Threads:") && absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(8)), &n)) {
      return n;
    }
  }
  return -1;
}

class HostileProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("odyssey_hostile_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    if (controller_) {
      EXPECT_EQ(controller_->Terminate(), 0) << "log: " << controller_->log_path();
    }
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  void Start(std::vector<std::string> extra) {
    ControllerProcess::Options o;
    o.binary = testing::ControllerBinaryFromEnv();
    o.state_dir = (dir_ / "state").string();
    o.work_dir = dir_.string();
    o.extra_args = std::move(extra);
    auto c = ControllerProcess::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    controller_ = std::move(*c);
    channel_ = grpc::CreateChannel(controller_->address(), grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel_);
  }
  v1::Job MustCreate() {
    v1::CreateJobRequest req;
    v1::JobSpec* s = req.mutable_spec();
    s->mutable_model()->set_name("tiny");
    s->mutable_optimizer()->set_lr(1e-3);
    s->mutable_data()->set_seq_len(64);
    s->mutable_data()->set_batch_size(1);
    s->set_steps(10);
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    v1::Job job;
    grpc::Status st = jobs_->CreateJob(&ctx, req, &job);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return job;
  }
  grpc::Status GetJob(const std::string& name, v1::Job* job) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    v1::GetJobRequest req;
    req.set_name(name);
    return jobs_->GetJob(&ctx, req, job);
  }

  std::filesystem::path dir_;
  std::unique_ptr<ControllerProcess> controller_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
};

// A second Attach with a live worker's id is refused, and the first one keeps its job.
TEST_F(HostileProcessTest, ALiveWorkersIdCannotBeTakenOver) {
  Start({"--heartbeat-timeout=5"});
  FakeWorker w1(controller_->address(), "w1");
  v1::Job job = MustCreate();
  ASSERT_TRUE(w1.WaitForAssignment(job.name(), absl::Seconds(20)));
  auto stub = v1::WorkerService::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10));
  auto stream = stub->Attach(&ctx);
  v1::WorkerMessage hello;
  hello.mutable_hello()->set_worker_id("w1");
  stream->Write(hello);
  v1::ControllerMessage in;
  while (stream->Read(&in)) {
  }
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("hello.worker_id: \"w1\" is attached on a live stream"));
  v1::Job now;
  ASSERT_TRUE(GetJob(job.name(), &now).ok());
  EXPECT_EQ(now.state(), v1::Job::RUNNING);
  ASSERT_EQ(now.workers_size(), 1);
  EXPECT_TRUE(w1.Result(job.name(), 0, true, 10));
}

// A 10,000-byte name is INVALID_ARGUMENT with a bounded message (it used to echo it whole and
// come back as the transport's RESOURCE_EXHAUSTED); a non-canonical name is refused too.
TEST_F(HostileProcessTest, AHugeNameIsABoundedInvalidArgument) {
  Start({});
  v1::Job job;
  grpc::Status s = GetJob("jobs/" + std::string(10000, '7') + "x", &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message().substr(0, 200);
  EXPECT_LT(s.error_message().size(), 1024u);
  EXPECT_THAT(s.error_message(), HasSubstr("name: "));
  for (const char* bad : {"jobs/ 1", "jobs/+1", "jobs/1 "}) {
    s = GetJob(bad, &job);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
  }
}

// Streams beyond --max-threads get RESOURCE_EXHAUSTED instead of a thread each; once they are
// gone the controller serves again and its threads come back down.
TEST_F(HostileProcessTest, OpenStreamsBeyondTheThreadCapAreRefused) {
  Start({"--max-threads=32"});
  const v1::Job job = MustCreate();
  const int before = Threads(controller_->pid());
  ASSERT_GT(before, 0);
  struct Watch {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader;
  };
  std::vector<std::unique_ptr<Watch>> open;
  int accepted = 0, exhausted = 0;
  for (int i = 0; i < 80; ++i) {
    auto w = std::make_unique<Watch>();
    w->ctx.set_deadline(In(60));
    v1::WatchJobRequest req;
    req.set_name(job.name());
    w->reader = jobs_->WatchJob(&w->ctx, req);
    v1::JobEvent first;
    if (w->reader->Read(&first)) {  // the job's current state: the stream holds a thread now
      ++accepted;
      open.push_back(std::move(w));
    } else {
      const grpc::Status s = w->reader->Finish();
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
      exhausted += s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(exhausted, 0);
  // The streams' threads are within the cap (the rest: gRPC's pollers and the process's own).
  EXPECT_LE(Threads(controller_->pid()), before + 32) << "before: " << before << ", accepted " << accepted;
  for (auto& w : open) w->ctx.TryCancel();
  for (auto& w : open) w->reader->Finish();
  open.clear();
  // Served again, and the stream threads are gone (each watch notices within 250 ms).
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  v1::Job got;
  while (absl::Now() < deadline && (!GetJob(job.name(), &got).ok() || Threads(controller_->pid()) > before + 8)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // poll interval, bounded by the deadline
  }
  EXPECT_TRUE(GetJob(job.name(), &got).ok());
  EXPECT_LE(Threads(controller_->pid()), before + 8);
}

}  // namespace
}  // namespace odyssey::server
