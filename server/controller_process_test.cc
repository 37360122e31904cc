// Cross-process tests of odyssey-controller: the real binary on a loopback port picked at run
// time, driven over gRPC by clients and by fake workers that speak the Attach protocol.
// Every wait is on a condition with a deadline.
// Over 600 lines on purpose: one concern (the binary end to end) whose tests share one
// fixture (the child process, its clients and fake workers); splitting it would copy the fixture.
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
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
using ::testing::Not;

constexpr absl::Duration kWait = absl::Seconds(20);

v1::JobSpec Spec(int world = 1, int steps = 10, int restart_limit = 0) {
  v1::JobSpec s;
  s.mutable_model()->set_name("tiny");
  s.mutable_optimizer()->set_lr(1e-3);
  s.mutable_data()->set_format("kjv");
  s.mutable_data()->set_seq_len(64);
  s.mutable_data()->set_batch_size(1);
  s.mutable_parallel()->set_world_size(world);
  s.set_steps(steps);
  s.set_restart_limit(restart_limit);
  return s;
}

class ControllerProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("odyssey_ctl_proc_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    workers_.clear();
    jobs_.reset();
    channel_.reset();
    // SIGTERM must stop it cleanly (exit 0): no crash on shutdown with streams open.
    if (controller_) {
      EXPECT_EQ(controller_->Terminate(), 0) << "log: " << controller_->log_path();
    }
    controller_.reset();
    if (!HasFailure() && !std::getenv("ODYSSEY_KEEP_TEST_DIRS")) std::filesystem::remove_all(dir_);
  }

  void StartController(std::vector<std::string> extra = {"--heartbeat-timeout=5"}) {
    ControllerProcess::Options o;
    o.binary = testing::ControllerBinaryFromEnv();
    o.state_dir = (dir_ / "state").string();
    o.work_dir = dir_.string();
    o.extra_args = std::move(extra);
    auto c = ControllerProcess::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    controller_ = std::move(*c);
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    channel_ = grpc::CreateCustomChannel(controller_->address(), grpc::InsecureChannelCredentials(), args);
    jobs_ = v1::JobService::NewStub(channel_);
  }

  FakeWorker* AddWorker(const std::string& id, std::vector<std::string> held = {}) {
    workers_.push_back(std::make_unique<FakeWorker>(controller_->address(), id, std::move(held)));
    return workers_.back().get();
  }

  grpc::Status Create(const v1::JobSpec& spec, v1::Job* job, const std::string& request_id = "") {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::CreateJobRequest req;
    *req.mutable_spec() = spec;
    req.set_request_id(request_id);
    return jobs_->CreateJob(&ctx, req, job);
  }
  v1::Job MustCreate(const v1::JobSpec& spec, const std::string& request_id = "") {
    v1::Job job;
    grpc::Status s = Create(spec, &job, request_id);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }
  grpc::Status Get(const std::string& name, v1::Job* job) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetJobRequest req;
    req.set_name(name);
    return jobs_->GetJob(&ctx, req, job);
  }
  v1::Job MustGet(const std::string& name) {
    v1::Job job;
    grpc::Status s = Get(name, &job);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }
  // Polls GetJob until the job is in `state` or the deadline passes.
  bool WaitForState(const std::string& name, v1::Job::State state, absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      v1::Job job;
      if (Get(name, &job).ok() && job.state() == state) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // poll interval, bounded by the deadline
    }
    return false;
  }
  std::vector<v1::Job> ListAll() {
    std::vector<v1::Job> out;
    v1::ListJobsRequest req;
    req.set_page_size(100);
    while (true) {
      grpc::ClientContext ctx;
      v1::ListJobsResponse resp;
      grpc::Status s = jobs_->ListJobs(&ctx, req, &resp);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok()) break;
      out.insert(out.end(), resp.jobs().begin(), resp.jobs().end());
      if (resp.next_page_token().empty()) break;
      req.set_page_token(resp.next_page_token());
    }
    return out;
  }
  // Opens Attach, sends one message built by `fill`, and returns how the controller ended it.
  grpc::Status AttachWith(const std::function<void(v1::WorkerMessage&)>& fill) {
    auto stub = v1::WorkerService::NewStub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto stream = stub->Attach(&ctx);
    v1::WorkerMessage m;
    fill(m);
    stream->Write(m);
    stream->WritesDone();
    v1::ControllerMessage in;
    while (stream->Read(&in)) {
    }
    return stream->Finish();
  }
  FakeWorker* WorkerById(const std::string& id) {
    for (auto& w : workers_) {
      if (w->id() == id) return w.get();
    }
    return nullptr;
  }

  std::filesystem::path dir_;
  std::unique_ptr<ControllerProcess> controller_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::vector<std::unique_ptr<FakeWorker>> workers_;
};

TEST_F(ControllerProcessTest, SameRequestIdCreatesOneJob) {
  StartController();
  v1::Job a = MustCreate(Spec(), "retry-me");
  v1::Job b = MustCreate(Spec(), "retry-me");
  EXPECT_EQ(a.name(), b.name());
  EXPECT_EQ(ListAll().size(), 1u);
  v1::Job c = MustCreate(Spec(), "another");
  EXPECT_NE(c.name(), a.name());
  EXPECT_EQ(ListAll().size(), 2u);
}

// A controller.db that lost its contents (0 bytes) does not start as an empty store (its job
// ids would restart at jobs/1 and reuse the old jobs' default checkpoint folders): the binary
// exits naming the file and the flag; with --init-store it starts a new store, and from then on
// opens it without the flag.
TEST_F(ControllerProcessTest, AnEmptyStoreIsRefusedUnlessInitIsAsked) {
  StartController();
  EXPECT_EQ(MustCreate(Spec()).name(), "jobs/1");
  jobs_.reset();
  channel_.reset();
  ASSERT_EQ(controller_->Terminate(), 0);
  controller_.reset();
  const std::filesystem::path db = dir_ / "state" / "controller.db";
  for (const char* suffix : {"-wal", "-shm"}) std::filesystem::remove(db.string() + suffix);
  std::filesystem::resize_file(db, 0);

  ControllerProcess::Options o;
  o.binary = testing::ControllerBinaryFromEnv();
  o.state_dir = (dir_ / "state").string();
  o.work_dir = (dir_ / "refused").string();
  auto refused = ControllerProcess::Start(o);
  ASSERT_FALSE(refused.ok()) << "started on a 0-byte store";
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("job store " + db.string() + " is empty (0 bytes), not an odyssey job store"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--init-store"));
  EXPECT_EQ(std::filesystem::file_size(db), 0u);

  StartController({"--init-store"});
  EXPECT_TRUE(ListAll().empty());
  const v1::Job job = MustCreate(Spec());
  jobs_.reset();
  channel_.reset();
  ASSERT_EQ(controller_->Terminate(), 0);
  controller_.reset();
  StartController();  // an odyssey store now
  EXPECT_EQ(MustGet(job.name()).name(), job.name());
}

TEST_F(ControllerProcessTest, GangSchedulingOneRunsTheOtherWaitsThenRuns) {
  StartController();
  FakeWorker* w[3] = {AddWorker("w1"), AddWorker("w2"), AddWorker("w3")};
  v1::Job j1 = MustCreate(Spec(2));
  v1::Job j2 = MustCreate(Spec(2));
  // Placement happens inside CreateJob: j1 has its gang, j2 cannot (one idle worker).
  ASSERT_TRUE(WaitForState(j1.name(), v1::Job::RUNNING));
  EXPECT_EQ(MustGet(j2.name()).state(), v1::Job::PENDING);
  const v1::Job running = MustGet(j1.name());
  ASSERT_EQ(running.workers_size(), 2);
  for (int rank = 0; rank < 2; ++rank) {
    FakeWorker* fw = WorkerById(running.workers(rank));
    auto a = fw->WaitForAssignment(j1.name(), kWait);
    ASSERT_TRUE(a) << running.workers(rank);
    EXPECT_EQ(a->rank(), rank);
    EXPECT_EQ(a->world_size(), 2);
  }
  int assignments = 0;
  for (FakeWorker* fw : w) assignments += fw->Assignments().size();
  EXPECT_EQ(assignments, 2);  // nothing of j2 was started partially
  EXPECT_EQ(MustGet(j2.name()).state(), v1::Job::PENDING);

  // j1 ends; its workers free up and j2 gets a whole gang.
  ASSERT_TRUE(WorkerById(running.workers(0))->Progress(j1.name(), 0, 10, 640));
  ASSERT_TRUE(WorkerById(running.workers(1))->Result(j1.name(), 1, true, 10));
  ASSERT_TRUE(WorkerById(running.workers(0))->Result(j1.name(), 0, true, 10));
  ASSERT_TRUE(WaitForState(j1.name(), v1::Job::SUCCEEDED));
  ASSERT_TRUE(WaitForState(j2.name(), v1::Job::RUNNING));
  const v1::Job second = MustGet(j2.name());
  ASSERT_EQ(second.workers_size(), 2);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(WorkerById(second.workers(rank))->WaitForAssignment(j2.name(), kWait));
  }
  for (int rank = 1; rank >= 0; --rank) ASSERT_TRUE(WorkerById(second.workers(rank))->Result(j2.name(), rank, true, 10));
  EXPECT_TRUE(WaitForState(j2.name(), v1::Job::SUCCEEDED));
}

TEST_F(ControllerProcessTest, KillDashNineAndRestartKeepsJobsAndWorkerReattaches) {
  StartController({"--heartbeat-timeout=5"});
  FakeWorker* w1 = AddWorker("w1");
  v1::Job running = MustCreate(Spec(1, 10, 1));
  v1::Job waiting = MustCreate(Spec(2));  // needs 2 workers; only 1 exists
  v1::Job cancelled = MustCreate(Spec(1));
  {
    grpc::ClientContext ctx;
    v1::CancelJobRequest req;
    req.set_name(cancelled.name());
    v1::Job out;
    ASSERT_TRUE(jobs_->CancelJob(&ctx, req, &out).ok());
  }
  ASSERT_TRUE(w1->WaitForAssignment(running.name(), kWait));
  const std::string ckpt = (dir_ / "ckpt-step-4").string();
  ASSERT_TRUE(w1->Progress(running.name(), 0, 4, 256, 2.5, ckpt));
  // Wait until the controller has recorded the checkpoint, then kill it mid-job.
  const absl::Time deadline = absl::Now() + kWait;
  while (MustGet(running.name()).last_checkpoint() != ckpt && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(MustGet(running.name()).last_checkpoint(), ckpt);
  controller_->Kill9();
  workers_.clear();  // the worker's stream broke; it re-attaches to the new controller

  StartController({"--heartbeat-timeout=5"});
  const v1::Job after = MustGet(running.name());
  EXPECT_EQ(after.state(), v1::Job::RUNNING);
  EXPECT_EQ(after.step(), 4);
  EXPECT_EQ(after.last_checkpoint(), ckpt);
  EXPECT_EQ(MustGet(waiting.name()).state(), v1::Job::PENDING);
  EXPECT_EQ(MustGet(cancelled.name()).state(), v1::Job::CANCELLED);
  EXPECT_EQ(ListAll().size(), 3u);

  FakeWorker* again = AddWorker("w1", {running.name()});
  ASSERT_TRUE(again->Progress(running.name(), 0, 5, 64));
  ASSERT_TRUE(again->Result(running.name(), 0, true, 10));
  ASSERT_TRUE(WaitForState(running.name(), v1::Job::SUCCEEDED));
  const v1::Job done = MustGet(running.name());
  EXPECT_EQ(done.restarts(), 0);  // it continued on the same worker, no restart
  EXPECT_EQ(done.step(), 10);
  EXPECT_TRUE(again->Assignments().empty());
}

TEST_F(ControllerProcessTest, WorkerLossRestartsFromLastCheckpoint) {
  StartController({"--heartbeat-timeout=1"});
  auto w1 = std::make_unique<FakeWorker>(controller_->address(), "w1");
  v1::Job job = MustCreate(Spec(1, 10, 1));
  ASSERT_TRUE(w1->WaitForAssignment(job.name(), kWait));
  ASSERT_TRUE(w1->Progress(job.name(), 0, 6, 64, 1.0, "/ckpt/step-6"));
  FakeWorker* w2 = AddWorker("w2");
  w1.reset();  // the worker dies (stream gone, never back)
  auto a = w2->WaitForAssignment(job.name(), kWait);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->resume_from(), "/ckpt/step-6");
  EXPECT_EQ(MustGet(job.name()).restarts(), 1);
}

TEST_F(ControllerProcessTest, BadRequestsGetTheCodeAndNameTheField) {
  StartController({"--heartbeat-timeout=5", "--max-message-bytes=65536"});
  FakeWorker* w = AddWorker("w1");
  v1::Job done = MustCreate(Spec());
  ASSERT_TRUE(w->WaitForAssignment(done.name(), kWait));
  ASSERT_TRUE(w->Result(done.name(), 0, true, 10));
  ASSERT_TRUE(WaitForState(done.name(), v1::Job::SUCCEEDED));
  const std::string dataset_missing = (dir_ / "missing.jsonl").string();

  struct Case {
    std::string what;
    std::function<grpc::Status()> call;
    grpc::StatusCode code;
    std::string field;
  };
  auto create = [this](std::function<void(v1::JobSpec&)> mutate) {
    return [this, mutate] {
      v1::JobSpec spec = Spec();
      mutate(spec);
      v1::Job job;
      return Create(spec, &job);
    };
  };
  const std::vector<Case> cases = {
      {"unknown model", create([](v1::JobSpec& s) { s.mutable_model()->set_name("gpt-17"); }),
       grpc::StatusCode::INVALID_ARGUMENT, "spec.model.name"},
      {"zero steps", create([](v1::JobSpec& s) { s.set_steps(0); }), grpc::StatusCode::INVALID_ARGUMENT, "spec.steps"},
      {"negative steps", create([](v1::JobSpec& s) { s.set_steps(-3); }), grpc::StatusCode::INVALID_ARGUMENT, "spec.steps"},
      {"zero lr", create([](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(0); }), grpc::StatusCode::INVALID_ARGUMENT,
       "spec.optimizer.lr"},
      {"negative lr", create([](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(-1e-3); }),
       grpc::StatusCode::INVALID_ARGUMENT, "spec.optimizer.lr"},
      {"seq_len above the model", create([](v1::JobSpec& s) { s.mutable_data()->set_seq_len(10'000'000); }),
       grpc::StatusCode::INVALID_ARGUMENT, "spec.data.seq_len"},
      {"unreadable dataset", create([&](v1::JobSpec& s) {
         s.mutable_data()->set_format("jsonl");
         s.mutable_data()->set_path(dataset_missing);
       }), grpc::StatusCode::INVALID_ARGUMENT, "spec.data.path"},
      {"cp does not divide world", create([](v1::JobSpec& s) {
         s.mutable_parallel()->set_world_size(2);
         s.mutable_parallel()->set_context_parallel(3);
       }), grpc::StatusCode::INVALID_ARGUMENT, "spec.parallel.context_parallel"},
      {"no spec", [this] {
         grpc::ClientContext ctx;
         v1::CreateJobRequest req;
         v1::Job job;
         return jobs_->CreateJob(&ctx, req, &job);
       }, grpc::StatusCode::INVALID_ARGUMENT, "spec"},
      {"get missing job", [this] {
         v1::Job job;
         return Get("jobs/987654", &job);
       }, grpc::StatusCode::NOT_FOUND, "name"},
      {"malformed name", [this] {
         v1::Job job;
         return Get("projects/1", &job);
       }, grpc::StatusCode::INVALID_ARGUMENT, "name"},
      {"cancel a SUCCEEDED job", [&] {
         grpc::ClientContext ctx;
         v1::CancelJobRequest req;
         req.set_name(done.name());
         v1::Job job;
         return jobs_->CancelJob(&ctx, req, &job);
       }, grpc::StatusCode::FAILED_PRECONDITION, "name"},
      {"cancel a missing job", [this] {
         grpc::ClientContext ctx;
         v1::CancelJobRequest req;
         req.set_name("jobs/424242");
         v1::Job job;
         return jobs_->CancelJob(&ctx, req, &job);
       }, grpc::StatusCode::NOT_FOUND, "name"},
      {"page size too big", [this] {
         grpc::ClientContext ctx;
         v1::ListJobsRequest req;
         req.set_page_size(100000);
         v1::ListJobsResponse resp;
         return jobs_->ListJobs(&ctx, req, &resp);
       }, grpc::StatusCode::INVALID_ARGUMENT, "page_size"},
      {"bad page token", [this] {
         grpc::ClientContext ctx;
         v1::ListJobsRequest req;
         req.set_page_token("not-a-token");
         v1::ListJobsResponse resp;
         return jobs_->ListJobs(&ctx, req, &resp);
       }, grpc::StatusCode::INVALID_ARGUMENT, "page_token"},
      {"watch missing job", [this] {
         grpc::ClientContext ctx;
         v1::WatchJobRequest req;
         req.set_name("jobs/31337");
         auto reader = jobs_->WatchJob(&ctx, req);
         v1::JobEvent e;
         while (reader->Read(&e)) {
         }
         return reader->Finish();
       }, grpc::StatusCode::NOT_FOUND, "name"},
      {"attach without hello", [this] { return AttachWith([](v1::WorkerMessage& m) { m.mutable_heartbeat(); }); },
       grpc::StatusCode::INVALID_ARGUMENT, "hello"},
      {"hello without worker_id", [this] { return AttachWith([](v1::WorkerMessage& m) { m.mutable_hello(); }); },
       grpc::StatusCode::INVALID_ARGUMENT, "hello.worker_id"},
      {"oversized message", create([](v1::JobSpec& s) { s.set_display_name(std::string(200000, 'x')); }),
       grpc::StatusCode::RESOURCE_EXHAUSTED, ""},
  };
  for (const Case& c : cases) {
    grpc::Status s = c.call();
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << s.error_message();
    if (!c.field.empty()) {
      EXPECT_THAT(s.error_message(), HasSubstr(c.field + ":")) << c.what;
    }
  }
  // No input crashed the controller, and it still serves.
  EXPECT_EQ(MustGet(done.name()).state(), v1::Job::SUCCEEDED);
}

// Parses Prometheus text into "name{labels}" -> value.
std::map<std::string, double> Scrape(int port) {
  std::map<std::string, double> out;
  httplib::Client client("127.0.0.1", port);
  auto res = client.Get("/metrics");
  if (!res || res->status != 200) return out;
  for (absl::string_view line : absl::StrSplit(res->body, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double value = 0;
    if (space == absl::string_view::npos || !absl::SimpleAtod(line.substr(space + 1), &value)) continue;
    out[std::string(line.substr(0, space))] = value;
  }
  return out;
}

TEST_F(ControllerProcessTest, MetricsAreScrapedAndMoveWithTheWork) {
  StartController();
  auto before = Scrape(controller_->metrics_port());
  ASSERT_FALSE(before.empty());
  EXPECT_EQ(before["odyssey_jobs{state=\"pending\"}"], 0);
  EXPECT_EQ(before["odyssey_tokens_total"], 0);
  EXPECT_EQ(before["odyssey_workers{state=\"idle\"}"], 0);

  FakeWorker* w = AddWorker("w1");
  v1::Job job = MustCreate(Spec());
  MustCreate(Spec(2));  // waits: one worker only
  ASSERT_TRUE(w->WaitForAssignment(job.name(), kWait));
  ASSERT_TRUE(w->Progress(job.name(), 0, 1, 1000, 3.0, "", 0.5));
  ASSERT_TRUE(w->Progress(job.name(), 0, 2, 1000, 2.0, "", 0.25));
  const absl::Time deadline = absl::Now() + kWait;
  std::map<std::string, double> mid;
  do {
    mid = Scrape(controller_->metrics_port());
  } while (mid["odyssey_tokens_total"] < 2000 && absl::Now() < deadline);
  EXPECT_EQ(mid["odyssey_tokens_total"], 2000);
  EXPECT_EQ(mid["odyssey_step_duration_seconds_count"], 2);
  EXPECT_DOUBLE_EQ(mid["odyssey_step_duration_seconds_sum"], 0.75);
  const std::string job_id = "{job_id=\"" + job.name().substr(5) + "\"}";  // "jobs/N" -> N
  EXPECT_DOUBLE_EQ(mid["odyssey_job_loss" + job_id], 2.0);  // the last step's
  EXPECT_EQ(mid.count("odyssey_job_grad_norm" + job_id), 1u);
  EXPECT_EQ(mid.count("odyssey_job_learning_rate" + job_id), 1u);
  bool build_info = false;
  for (const auto& [series, value] : mid) build_info |= absl::StartsWith(series, "odyssey_build_info{") && value == 1;
  EXPECT_TRUE(build_info);
  EXPECT_EQ(mid["odyssey_jobs{state=\"running\"}"], 1);
  EXPECT_EQ(mid["odyssey_jobs{state=\"pending\"}"], 1);
  EXPECT_EQ(mid["odyssey_queue_depth"], 1);
  EXPECT_EQ(mid["odyssey_workers{state=\"busy\"}"], 1);
  EXPECT_GE(mid["odyssey_rpc_duration_seconds_count{method=\"CreateJob\"}"], 2);

  ASSERT_TRUE(w->Result(job.name(), 0, true, 2));
  ASSERT_TRUE(WaitForState(job.name(), v1::Job::SUCCEEDED));
  auto after = Scrape(controller_->metrics_port());
  EXPECT_EQ(after["odyssey_jobs{state=\"succeeded\"}"], 1);
  EXPECT_EQ(after["odyssey_jobs{state=\"running\"}"], 0);
  EXPECT_EQ(after["odyssey_workers{state=\"idle\"}"], 1);
  EXPECT_GT(after["odyssey_rpc_duration_seconds_count{method=\"GetJob\"}"], 0);
  EXPECT_EQ(after.count("odyssey_job_loss" + job_id), 0u);  // per-job series end with the job
}

TEST_F(ControllerProcessTest, HealthCheckServes) {
  StartController();
  // grpc.health.v1.Health/Check with an empty request; SERVING is field 1 = 1 (bytes 08 01).
  grpc::GenericStub generic(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::ByteBuffer request, response;
  grpc::Slice empty("", 0);
  request = grpc::ByteBuffer(&empty, 1);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> lock(mu);
                      status = s;
                      done = true;
                      cv.notify_all();
                    });
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return done; }));
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
}

// One ServerReflectionInfo exchange: `request` (a serialized ServerReflectionRequest) in, the
// serialized response out, through the generic async API (no reflection stubs needed).
std::string ReflectionExchange(const std::shared_ptr<grpc::Channel>& channel, const std::string& request) {
  grpc::GenericStub generic(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto call = generic.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto next = [&](intptr_t want) {
    void* tag = nullptr;
    bool ok = false;
    if (!cq.Next(&tag, &ok)) return false;  // bounded by the context deadline
    return ok && reinterpret_cast<intptr_t>(tag) == want;
  };
  std::string bytes;
  call->StartCall(reinterpret_cast<void*>(1));
  EXPECT_TRUE(next(1));
  grpc::Slice request_bytes(request);
  grpc::ByteBuffer request_buffer(&request_bytes, 1);
  call->Write(request_buffer, reinterpret_cast<void*>(2));
  EXPECT_TRUE(next(2));
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(3));
  if (next(3)) {
    std::vector<grpc::Slice> slices;
    EXPECT_TRUE(response.Dump(&slices).ok());
    for (auto& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  } else {
    ADD_FAILURE() << "no reflection response";
  }
  call->WritesDone(reinterpret_cast<void*>(4));
  EXPECT_TRUE(next(4));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  EXPECT_TRUE(next(5));
  EXPECT_TRUE(status.ok()) << status.error_message();
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  return bytes;
}

TEST_F(ControllerProcessTest, ServerReflectionListsTheServices) {
  StartController();
  // list_services = "" (field 7, length 0: bytes 3a 00).
  const std::string bytes = ReflectionExchange(channel_, std::string("\x3a\x00", 2));
  EXPECT_THAT(bytes, HasSubstr("odyssey.v1.JobService"));
  EXPECT_THAT(bytes, HasSubstr("odyssey.v1.WorkerService"));
  EXPECT_THAT(bytes, HasSubstr("odyssey.v1.TrainingService"));
  EXPECT_THAT(bytes, HasSubstr("grpc.health.v1.Health"));
}

// What `grpcurl -plaintext HOST:PORT grpc.health.v1.Health/Check` asks before calling: the file
// that defines the service. Before, reflection listed the health service but could not describe
// it (gRPC's default health service has no descriptor), so grpcurl needed -proto.
TEST_F(ControllerProcessTest, ReflectionDescribesTheHealthServiceForGrpcurl) {
  StartController();
  // file_containing_symbol (field 4) = "grpc.health.v1.Health".
  const std::string symbol = "grpc.health.v1.Health";
  const std::string bytes =
      ReflectionExchange(channel_, std::string("\x22", 1) + static_cast<char>(symbol.size()) + symbol);
  ASSERT_FALSE(bytes.empty());
  // ServerReflectionResponse: file_descriptor_response is field 4 (tag 0x22), error_response
  // field 7 (tag 0x3a) after the echoed original_request (field 2).
  EXPECT_THAT(bytes, HasSubstr("grpc/health/v1/health.proto"));
  EXPECT_THAT(bytes, HasSubstr("HealthCheckRequest"));
  EXPECT_THAT(bytes, HasSubstr("HealthCheckResponse"));
  EXPECT_THAT(bytes, HasSubstr("SERVING"));
  EXPECT_THAT(bytes, Not(HasSubstr("not found")));
}

// TrainingService through the real binary and a fake worker: a call reaches the worker as a
// TrainingCall, its TrainingReply answers the client; edge rejections never reach the worker;
// the worker's stream ending fails a pending call with UNAVAILABLE; the calls are counted.
TEST_F(ControllerProcessTest, TrainingCallsRouteThroughTheWorkerStream) {
  StartController();
  FakeWorker* w1 = AddWorker("w1");
  v1::JobSpec spec = Spec();
  spec.set_kind(v1::RL_SESSION);
  spec.clear_steps();
  const v1::Job job = MustCreate(spec);
  ASSERT_TRUE(WaitForState(job.name(), v1::Job::RUNNING));
  auto training = v1::TrainingService::NewStub(channel_);
  v1::ForwardBackwardRequest fb;
  fb.set_job(job.name());
  v1::Datum* d = fb.add_batch();
  d->add_tokens(1);
  d->add_target_tokens(2);
  fb.mutable_loss()->set_kind("cross_entropy");

  auto call_async = [&](v1::ForwardBackwardResponse* response, grpc::Status* status) {
    return std::thread([&training, fb, response, status] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      *status = training->ForwardBackward(&ctx, fb, response);
    });
  };
  v1::ForwardBackwardResponse response;
  grpc::Status status;
  std::thread first = call_async(&response, &status);
  auto call = w1->WaitFor([](const v1::ControllerMessage& m) { return m.has_call(); }, kWait);
  ASSERT_TRUE(call.has_value());
  EXPECT_EQ(call->call().job(), job.name());
  EXPECT_EQ(call->call().forward_backward().batch(0).target_tokens(0), 2);
  v1::WorkerMessage reply;
  reply.mutable_reply()->set_call_id(call->call().call_id());
  reply.mutable_reply()->set_job(job.name());
  reply.mutable_reply()->mutable_forward_backward()->set_loss(1.5);
  reply.mutable_reply()->mutable_forward_backward()->set_mismatch_mean(0.03);
  reply.mutable_reply()->mutable_forward_backward()->set_mismatch_tokens(1);
  ASSERT_TRUE(w1->Send(reply));
  first.join();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_DOUBLE_EQ(response.loss(), 1.5);

  // Rejected at the edge: never forwarded.
  {
    grpc::ClientContext ctx;
    v1::OptimStepRequest bad;
    bad.set_job(job.name());
    bad.mutable_adam()->set_lr(-1);
    v1::OptimStepResponse out;
    grpc::Status s = training->OptimStep(&ctx, bad, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("adam.lr:"));
  }

  // The worker goes away with a call pending: UNAVAILABLE, not a hang.
  const int64_t first_id = call->call().call_id();
  std::thread second = call_async(&response, &status);
  ASSERT_TRUE(w1->WaitFor([first_id](const v1::ControllerMessage& m) { return m.has_call() && m.call().call_id() != first_id; },
                          kWait)
                  .has_value());
  w1->Close();
  second.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("worker w1 disconnected"));

  auto m = Scrape(controller_->metrics_port());
  EXPECT_EQ((m["odyssey_training_calls_total{code=\"OK\",method=\"ForwardBackward\"}"]), 1);
  EXPECT_EQ((m["odyssey_training_calls_total{code=\"UNAVAILABLE\",method=\"ForwardBackward\"}"]), 1);
  EXPECT_EQ((m["odyssey_training_calls_total{code=\"INVALID_ARGUMENT\",method=\"OptimStep\"}"]), 1);
  EXPECT_DOUBLE_EQ((m["odyssey_rl_logprob_mismatch_mean{job_id=\"" + job.name().substr(5) + "\"}"]), 0.03);
}

// 32 concurrent clients x 50 mixed requests: every one answered, no job lost. Prints latency.
TEST_F(ControllerProcessTest, ConcurrentClientsAllAnsweredNoneLost) {
  StartController();
  constexpr int kClients = 32;
  constexpr int kRequests = 50;
  std::vector<std::vector<double>> latencies(kClients);
  std::vector<std::vector<std::string>> created(kClients);
  std::atomic<int> answered{0}, unexpected{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      auto stub = v1::JobService::NewStub(
          grpc::CreateChannel(controller_->address(), grpc::InsecureChannelCredentials()));
      std::mt19937 rng(c);
      for (int i = 0; i < kRequests; ++i) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        const absl::Time start = absl::Now();
        grpc::Status s;
        const int kind = (i < 2) ? 0 : static_cast<int>(rng() % 4);
        if (kind == 0) {
          v1::CreateJobRequest req;
          *req.mutable_spec() = Spec(2);  // no workers: stays PENDING
          req.set_request_id(absl::StrCat("load-", c, "-", i));
          v1::Job job;
          s = stub->CreateJob(&ctx, req, &job);
          if (s.ok()) created[c].push_back(job.name());
        } else if (kind == 1) {
          v1::GetJobRequest req;
          req.set_name(created[c][rng() % created[c].size()]);
          v1::Job job;
          s = stub->GetJob(&ctx, req, &job);
        } else if (kind == 2) {
          v1::ListJobsRequest req;
          req.set_page_size(20);
          v1::ListJobsResponse resp;
          s = stub->ListJobs(&ctx, req, &resp);
        } else {
          v1::CancelJobRequest req;
          req.set_name(created[c][rng() % created[c].size()]);
          v1::Job job;
          s = stub->CancelJob(&ctx, req, &job);
        }
        latencies[c].push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
        if (s.ok()) {
          ++answered;
        } else {
          ++unexpected;
          ADD_FAILURE() << "client " << c << " request " << i << ": " << s.error_message();
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(answered.load(), kClients * kRequests);
  EXPECT_EQ(unexpected.load(), 0);
  size_t total_created = 0;
  for (const auto& v : created) total_created += v.size();
  EXPECT_EQ(ListAll().size(), total_created);  // every created job is there, none lost
  for (const auto& v : created) {
    for (const auto& name : v) {
      v1::Job job;
      EXPECT_TRUE(Get(name, &job).ok()) << name;
    }
  }
  std::vector<double> all;
  for (const auto& v : latencies) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  auto pct = [&](double p) { return all[std::min(all.size() - 1, static_cast<size_t>(p * all.size()))]; };
  std::printf("BENCHMARK controller_concurrent_clients: %d clients x %d mixed requests = %zu answered; "
              "latency p50 %.2f ms, p99 %.2f ms, max %.2f ms\n",
              kClients, kRequests, all.size(), pct(0.50), pct(0.99), all.back());
}

}  // namespace
}  // namespace odyssey::server
