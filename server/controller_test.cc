#include "server/controller.h"

#include <filesystem>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "absl/synchronization/notification.h"
#include "prometheus/text_serializer.h"
#include "server/auth.h"
#include "server/validation.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;
using ::testing::HasSubstr;

// Callers of these tests are the anonymous tenant (auth off), except in the tenant tests.
const std::string kAnon = kAnonymousTenant;

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
  Attached Attach(const std::string& id, const std::string& host = "127.0.0.1") {
    v1::WorkerCapabilities caps;
    caps.set_worker_id(id);
    caps.set_device("cpu");
    auto conn = std::make_shared<FakeConnection>();
    auto session = controller_->AttachWorker(caps, host, conn);
    EXPECT_TRUE(session.ok());
    return {conn, *session};
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

TEST_F(ControllerTest, SameRequestIdCreatesOneJob) {
  auto a = controller_->CreateJob(Request(1, 10, "rid-1"), kAnon);
  auto b = controller_->CreateJob(Request(1, 10, "rid-1"), kAnon);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->name(), b->name());
  auto c = controller_->CreateJob(Request(1, 10, "rid-2"), kAnon);
  EXPECT_NE(c->name(), a->name());
  // Same id, different spec: refused, naming request_id.
  auto d = controller_->CreateJob(Request(1, 11, "rid-1"), kAnon);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("request_id:"));
  // And it survives a restart.
  Restart();
  auto e = controller_->CreateJob(Request(1, 10, "rid-1"), kAnon);
  EXPECT_EQ(e->name(), a->name());
  EXPECT_EQ(controller_->ListJobs({}, kAnon)->jobs_size(), 2);
}

// CreateJob runs the planner before anything is stored or allocated: a 3B model at 8M tokens
// fits no H200 (the machine assumed while no worker is attached), nor an attached 80 GB GPU;
// 64K fits. Only CPU workers attached: no GPU verdict.
TEST_F(ControllerTest, PlannerRefusesJobsThatCannotFit) {
  v1::CreateJobRequest big = Request(1);
  big.mutable_spec()->mutable_model()->set_name("llama-3.2-3b");
  big.mutable_spec()->mutable_data()->set_seq_len(int64_t{8} << 20);
  auto r = controller_->CreateJob(big, kAnon);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("spec.data.seq_len: does not fit: 8388608 tokens"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find(" by "), std::string::npos) << r.status();
  EXPECT_TRUE(controller_->ListJobs(v1::ListJobsRequest(), kAnon)->jobs().empty());

  v1::CreateJobRequest fits = big;
  fits.mutable_spec()->mutable_data()->set_seq_len(65536);
  EXPECT_TRUE(controller_->CreateJob(fits, kAnon).ok());

  v1::WorkerCapabilities caps;
  caps.set_worker_id("gpu-0");
  caps.set_device("cuda:0");
  caps.set_device_memory_bytes(int64_t{80} << 30);
  caps.set_host_memory_bytes(int64_t{64} << 30);
  ASSERT_TRUE(controller_->AttachWorker(caps, "127.0.0.1", std::make_shared<FakeConnection>()).ok());
  v1::CreateJobRequest mid = big;
  mid.mutable_spec()->mutable_data()->set_seq_len(int64_t{1} << 20);  // fits an H200, not 80 GB
  r = controller_->CreateJob(mid, kAnon);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
}

// PlannerService.Plan: the same verdicts as CreateJob's check, with the strategy and its
// peaks, on the hardware it names; the spec's memory fields win over the planner's choice;
// nothing is created.
TEST_F(ControllerTest, PlanAnswersWhatCreateJobWouldDecide) {
  constexpr int64_t kH200GpuBytes = int64_t{136} << 30;  // planner::Hardware's default
  v1::PlanRequest req;
  *req.mutable_spec() = Request(1).spec();
  req.mutable_spec()->mutable_model()->set_name("llama-3.2-3b");
  req.mutable_spec()->mutable_data()->set_seq_len(65536);
  req.set_max_seq_len(true);
  auto p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fits()) << p->message();
  EXPECT_EQ(p->memory().recompute(), "layer");
  EXPECT_EQ(p->hardware(), "an H200 host (no GPU worker is attached)");
  EXPECT_EQ(p->planned_gpu_bytes(), kH200GpuBytes);
  EXPECT_GT(p->gpu_peak_bytes(), int64_t{20} << 30);
  EXPECT_LE(p->gpu_peak_bytes(), p->planned_gpu_bytes());
  int64_t sum = 0;
  for (const auto& t : p->terms()) sum += t.bytes();
  EXPECT_GE(sum, p->gpu_peak_bytes());  // the peak is the larger of two phases' sums
  EXPECT_GE(p->max_seq_len(), int64_t{1} << 20);  // the planner's longest for 3B on an H200: 1.41M

  // Every memory field set: that strategy, whether or not it fits (no recompute at 128K).
  req.mutable_spec()->mutable_data()->set_seq_len(131072);
  v1::MemorySpec* m = req.mutable_spec()->mutable_memory();
  m->set_recompute("none");
  m->set_offload("off");
  m->set_mlp_tile_tokens(4096);
  m->set_loss_tile_tokens(2048);
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->fits());
  EXPECT_EQ(p->memory().recompute(), "none");
  EXPECT_EQ(p->memory().mlp_tile_tokens(), 4096);
  EXPECT_THAT(p->message(), HasSubstr("the strategy needs"));
  EXPECT_GT(p->gpu_peak_bytes(), p->planned_gpu_bytes());

  // One field set: the planner's choice for the rest.
  req.mutable_spec()->mutable_data()->set_seq_len(65536);
  req.mutable_spec()->clear_memory();
  req.mutable_spec()->mutable_memory()->set_loss_tile_tokens(1024);
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fits());
  EXPECT_EQ(p->memory().recompute(), "layer");
  EXPECT_EQ(p->memory().loss_tile_tokens(), 1024);

  // Too long for any strategy: not an error, fits = false with the planner's message.
  req.mutable_spec()->clear_memory();
  req.mutable_spec()->mutable_data()->set_seq_len(int64_t{8} << 20);
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->fits());
  EXPECT_THAT(p->message(), HasSubstr("does not fit: 8388608 tokens"));

  // An attached GPU worker is the machine; the request's bytes override it.
  v1::WorkerCapabilities caps;
  caps.set_worker_id("gpu-0");
  caps.set_device("cuda:0");
  caps.set_device_name("NVIDIA H100 80GB HBM3");
  caps.set_device_memory_bytes(int64_t{80} << 30);
  caps.set_host_memory_bytes(int64_t{64} << 30);
  ASSERT_TRUE(controller_->AttachWorker(caps, "127.0.0.1", std::make_shared<FakeConnection>()).ok());
  req.mutable_spec()->mutable_data()->set_seq_len(int64_t{1} << 20);
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->fits());  // fits an H200, not 80 GB (as CreateJob decides)
  EXPECT_EQ(p->planned_gpu_bytes(), (int64_t{80} << 30) - (int64_t{3} << 30));
  EXPECT_THAT(p->hardware(), HasSubstr("worker gpu-0 (NVIDIA H100 80GB HBM3"));
  EXPECT_LT(p->max_seq_len(), int64_t{1} << 20);
  req.set_gpu_bytes(kH200GpuBytes);
  req.set_host_bytes(int64_t{110} << 30);
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fits()) << p->message();
  EXPECT_EQ(p->hardware(), "the request");
  EXPECT_TRUE(controller_->ListJobs(v1::ListJobsRequest(), kAnon)->jobs().empty());

  req.mutable_spec()->mutable_model()->set_name("/nowhere/model");
  EXPECT_EQ(controller_->Plan(req).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ControllerTest, PlannerDoesNotJudgeCpuWorkers) {
  Attach("cpu-0");
  v1::CreateJobRequest big = Request(1);
  big.mutable_spec()->mutable_model()->set_name("llama-3.2-3b");
  big.mutable_spec()->mutable_data()->set_seq_len(int64_t{8} << 20);
  EXPECT_TRUE(controller_->CreateJob(big, kAnon).ok());
}

TEST_F(ControllerTest, GangSchedulingStartsWholeGangsOnly) {
  auto w1 = Attach("w1"), w2 = Attach("w2"), w3 = Attach("w3");
  auto j1 = *controller_->CreateJob(Request(2), kAnon);
  auto j2 = *controller_->CreateJob(Request(2), kAnon);
  EXPECT_EQ(Get(j1.name()).state(), v1::Job::RUNNING);
  EXPECT_EQ(Get(j2.name()).state(), v1::Job::PENDING);
  // Still one idle worker only: no partial start.
  now_ += absl::Seconds(1);
  controller_->Tick();
  EXPECT_EQ(Get(j2.name()).state(), v1::Job::PENDING);
  const v1::Job running = Get(j1.name());
  ASSERT_EQ(running.workers_size(), 2);
  int assigned = 0;
  std::set<int> ranks;
  for (auto* w : {&w1, &w2, &w3}) {
    for (const auto& a : w->conn->Assignments()) {
      ++assigned;
      EXPECT_EQ(a.job(), j1.name());
      EXPECT_EQ(a.world_size(), 2);
      EXPECT_EQ(a.resume_from(), "");
      EXPECT_EQ(a.rendezvous(), "127.0.0.1:" + std::to_string(29500 + 1));
      ranks.insert(a.rank());
    }
  }
  EXPECT_EQ(assigned, 2);
  EXPECT_EQ(ranks, (std::set<int>{0, 1}));

  // j1 finishes: rank 0's ok decides; each rank's result frees its worker.
  std::map<std::string, Attached*> by_id = {{"w1", &w1}, {"w2", &w2}, {"w3", &w3}};
  Progress(*by_id[running.workers(0)], j1.name(), 0, 10);
  Result(*by_id[running.workers(0)], j1.name(), 0, true);
  EXPECT_EQ(Get(j1.name()).state(), v1::Job::SUCCEEDED);
  // Rank 0's worker and w3 are idle now; rank 1's worker is busy until it reports.
  const v1::Job second = Get(j2.name());
  EXPECT_EQ(second.state(), v1::Job::RUNNING);
  EXPECT_THAT(second.workers(), ::testing::Not(::testing::Contains(running.workers(1))));
  Result(*by_id[running.workers(1)], j1.name(), 1, true);
  EXPECT_EQ(by_id[running.workers(1)]->conn->Count(v1::ControllerMessage::kRelease), 1);
}

TEST_F(ControllerTest, PriorityFirstThenFifo) {
  auto j1 = *controller_->CreateJob(Request(1, 10, "", 0), kAnon);
  auto j2 = *controller_->CreateJob(Request(1, 10, "", 5), kAnon);
  auto j3 = *controller_->CreateJob(Request(1, 10, "", 5), kAnon);
  auto w1 = Attach("w1");
  EXPECT_EQ(Get(j2.name()).state(), v1::Job::RUNNING);
  EXPECT_EQ(Get(j1.name()).state(), v1::Job::PENDING);
  EXPECT_EQ(Get(j3.name()).state(), v1::Job::PENDING);
}

TEST_F(ControllerTest, DeadWorkerRestartsFromCheckpointThenFailsAtLimit) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1, 10, "", 0, /*restart_limit=*/1), kAnon);
  Progress(w1, job.name(), 0, 4, "/ckpt/step-4");
  EXPECT_EQ(Get(job.name()).last_checkpoint(), "/ckpt/step-4");
  controller_->DetachWorker(w1.session);
  now_ += absl::Seconds(5);
  controller_->Tick();
  EXPECT_EQ(Get(job.name()).state(), v1::Job::RUNNING);  // within the timeout: may come back
  now_ += absl::Seconds(6);
  controller_->Tick();
  EXPECT_EQ(Get(job.name()).state(), v1::Job::PENDING);
  EXPECT_EQ(Get(job.name()).restarts(), 1);

  auto w2 = Attach("w2");
  auto assigns = w2.conn->Assignments();
  ASSERT_EQ(assigns.size(), 1u);
  EXPECT_EQ(assigns[0].resume_from(), "/ckpt/step-4");
  // A silent (hung) worker is dead after the timeout too; the limit is reached: FAILED.
  now_ += absl::Seconds(11);
  controller_->Tick();
  const v1::Job failed = Get(job.name());
  EXPECT_EQ(failed.state(), v1::Job::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("restart_limit (1) reached"));
  EXPECT_TRUE(w2.conn->closed);
}

TEST_F(ControllerTest, CancelRules) {
  auto w1 = Attach("w1");
  auto running = *controller_->CreateJob(Request(1), kAnon);
  auto pending = *controller_->CreateJob(Request(1), kAnon);
  EXPECT_EQ(controller_->CancelJob(*ParseJobName(pending.name()), kAnon)->state(), v1::Job::CANCELLED);
  EXPECT_EQ(controller_->CancelJob(*ParseJobName(running.name()), kAnon)->state(), v1::Job::CANCELLED);
  EXPECT_EQ(w1.conn->Count(v1::ControllerMessage::kCancel), 1);
  // Cancelling again is a no-op; the worker stays busy until it reports.
  EXPECT_EQ(controller_->CancelJob(*ParseJobName(running.name()), kAnon)->state(), v1::Job::CANCELLED);
  auto next = *controller_->CreateJob(Request(1), kAnon);
  EXPECT_EQ(Get(next.name()).state(), v1::Job::PENDING);
  Result(w1, running.name(), 0, false, "cancel requested");
  EXPECT_EQ(Get(running.name()).state(), v1::Job::CANCELLED);
  EXPECT_EQ(Get(next.name()).state(), v1::Job::RUNNING);
  Result(w1, next.name(), 0, true);
  auto done = controller_->CancelJob(*ParseJobName(next.name()), kAnon);
  EXPECT_EQ(done.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(done.status().message()), HasSubstr("SUCCEEDED"));
  EXPECT_EQ(controller_->CancelJob(12345, kAnon).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ControllerTest, RankErrorFailsJobAndCancelsOtherRanks) {
  auto w1 = Attach("w1"), w2 = Attach("w2");
  auto job = *controller_->CreateJob(Request(2), kAnon);
  const v1::Job running = Get(job.name());
  Attached& rank1 = running.workers(1) == "w1" ? w1 : w2;
  Attached& rank0 = running.workers(0) == "w1" ? w1 : w2;
  Result(rank1, job.name(), 1, false);
  const v1::Job failed = Get(job.name());
  EXPECT_EQ(failed.state(), v1::Job::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("boom"));
  EXPECT_EQ(rank0.conn->Count(v1::ControllerMessage::kCancel), 1);
}

TEST_F(ControllerTest, ControllerRestartKeepsRunningJobForReattachingWorker) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1), kAnon);
  Progress(w1, job.name(), 0, 3);
  Restart();
  EXPECT_EQ(Get(job.name()).state(), v1::Job::RUNNING);
  EXPECT_EQ(Get(job.name()).step(), 3);
  auto again = Attach("w1");
  v1::WorkerMessage held;
  held.mutable_held()->add_jobs(job.name());
  controller_->OnWorkerMessage(again.session, held);
  now_ += absl::Seconds(30);
  Progress(again, job.name(), 0, 4);  // keeps it alive
  controller_->Tick();
  EXPECT_EQ(Get(job.name()).state(), v1::Job::RUNNING);
  EXPECT_EQ(again.conn->Assignments().size(), 0u);
  Result(again, job.name(), 0, true);
  EXPECT_EQ(Get(job.name()).state(), v1::Job::SUCCEEDED);
}

TEST_F(ControllerTest, ControllerRestartWithoutWorkerRestartsJob) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1, 10, "", 0, 2), kAnon);
  Restart();
  now_ += absl::Seconds(11);
  controller_->Tick();
  EXPECT_EQ(Get(job.name()).state(), v1::Job::PENDING);
  EXPECT_EQ(Get(job.name()).restarts(), 1);
  // A worker that re-attaches without the job loses it too.
  auto w2 = Attach("w2");
  EXPECT_EQ(Get(job.name()).state(), v1::Job::RUNNING);
  Restart();
  auto w2b = Attach("w2");
  v1::WorkerMessage held;
  held.mutable_held();
  controller_->OnWorkerMessage(w2b.session, held);
  // Lost, restarted, and immediately placed on w2 again (it is idle now).
  EXPECT_EQ(Get(job.name()).restarts(), 2);
  EXPECT_EQ(Get(job.name()).state(), v1::Job::RUNNING);
  EXPECT_EQ(w2b.conn->Assignments().size(), 1u);
}

TEST_F(ControllerTest, ListJobsPagesNewestFirst) {
  for (int i = 0; i < 7; ++i) ASSERT_TRUE(controller_->CreateJob(Request(1), kAnon).ok());
  v1::ListJobsRequest r;
  r.set_page_size(3);
  std::vector<std::string> names;
  while (true) {
    auto page = controller_->ListJobs(r, kAnon);
    ASSERT_TRUE(page.ok());
    for (const auto& j : page->jobs()) names.push_back(j.name());
    if (page->next_page_token().empty()) break;
    r.set_page_token(page->next_page_token());
  }
  ASSERT_EQ(names.size(), 7u);
  EXPECT_EQ(names.front(), "jobs/7");
  EXPECT_EQ(names.back(), "jobs/1");
  v1::ListJobsRequest filtered;
  filtered.set_state(v1::Job::RUNNING);
  EXPECT_EQ(controller_->ListJobs(filtered, kAnon)->jobs_size(), 0);
}

TEST_F(ControllerTest, WatchDeliversStateStepsAndEnd) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1), kAnon);
  auto watch = *controller_->WatchJob(*ParseJobName(job.name()), kAnon);
  Progress(w1, job.name(), 0, 1, "/ckpt/1");
  Result(w1, job.name(), 0, true);
  std::vector<v1::JobEvent> events;
  while (auto e = watch->Next(absl::Seconds(1))) events.push_back(*e);
  EXPECT_TRUE(watch->done());
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.front().state(), v1::Job::RUNNING);
  EXPECT_TRUE(std::any_of(events.begin(), events.end(), [](auto& e) { return e.has_step(); }));
  EXPECT_TRUE(std::any_of(events.begin(), events.end(), [](auto& e) { return e.checkpoint() == "/ckpt/1"; }));
  EXPECT_EQ(events.back().state(), v1::Job::SUCCEEDED);
}

// ---------------------------------------------------------------------------------------------
// Tenants (auth on): each tenant sees and touches only its own jobs.

TEST_F(ControllerTest, CreateJobRecordsTheTenantAndItSurvivesARestart) {
  auto job = controller_->CreateJob(Request(1), "alice");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->tenant(), "alice");
  Restart();
  auto again = controller_->GetJob(*ParseJobName(job->name()), "alice");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tenant(), "alice");
  EXPECT_EQ(controller_->GetJob(*ParseJobName(job->name()), "bob").status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(ControllerTest, ListJobsShowsOnlyTheCallersJobs) {
  std::vector<std::string> alice, bob;
  for (int i = 0; i < 5; ++i) {
    alice.push_back(controller_->CreateJob(Request(1), "alice")->name());
    bob.push_back(controller_->CreateJob(Request(1), "bob")->name());
  }
  const std::string anonymous = controller_->CreateJob(Request(1), kAnon)->name();
  auto names = [&](const std::string& tenant, int page_size) {
    std::vector<std::string> out;
    v1::ListJobsRequest r;
    r.set_page_size(page_size);
    while (true) {
      auto page = controller_->ListJobs(r, tenant);
      EXPECT_TRUE(page.ok()) << page.status();
      for (const auto& j : page->jobs()) {
        EXPECT_EQ(j.tenant(), tenant) << j.name();
        out.push_back(j.name());
      }
      if (page->next_page_token().empty()) break;
      r.set_page_token(page->next_page_token());
    }
    std::reverse(out.begin(), out.end());  // oldest first, as created
    return out;
  };
  EXPECT_EQ(names("alice", 2), alice);  // pages of 2 over interleaved ids
  EXPECT_EQ(names("bob", 0), bob);
  EXPECT_EQ(names(kAnon, 0), std::vector<std::string>{anonymous});
  EXPECT_TRUE(names("carol", 0).empty());
  Restart();
  EXPECT_EQ(names("alice", 3), alice);
}

TEST_F(ControllerTest, AnotherTenantsJobIsPermissionDenied) {
  auto w1 = Attach("w1");
  const v1::Job job = *controller_->CreateJob(Request(1), "alice");
  const int64_t id = *ParseJobName(job.name());
  ASSERT_EQ(job.state(), v1::Job::RUNNING);
  const std::string want = "name: " + job.name() + " belongs to another tenant";
  for (const std::string& other : {std::string("bob"), kAnon}) {
    auto get = controller_->GetJob(id, other);
    EXPECT_EQ(get.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(get.status().message(), want);
    auto cancel = controller_->CancelJob(id, other);
    EXPECT_EQ(cancel.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(cancel.status().message(), want);
    auto watch = controller_->WatchJob(id, other);
    EXPECT_EQ(watch.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(watch.status().message(), want);
    absl::Status access = controller_->CheckJobAccess(id, other);
    EXPECT_EQ(access.code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(access.message(), want);
  }
  // The refused cancels did nothing: the job still runs and its worker got no cancel.
  EXPECT_EQ(controller_->GetJob(id, "alice")->state(), v1::Job::RUNNING);
  EXPECT_EQ(w1.conn->Count(v1::ControllerMessage::kCancel), 0);
  // The owner may do all of it.
  EXPECT_TRUE(controller_->CheckJobAccess(id, "alice").ok());
  EXPECT_TRUE(controller_->WatchJob(id, "alice").ok());
  EXPECT_EQ(controller_->CancelJob(id, "alice")->state(), v1::Job::CANCELLED);
  // A job that does not exist is NOT_FOUND for everyone.
  EXPECT_EQ(controller_->CheckJobAccess(9999, "alice").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(controller_->GetJob(9999, "bob").status().code(), absl::StatusCode::kNotFound);
}

// --path-root: a root with alice's and bob's folders and a shared read root (base models).
class PathConfinementTest : public ControllerTest {
 protected:
  void SetUp() override {
    ControllerTest::SetUp();
    root_ = (dir_ / "root").string();
    shared_ = (dir_ / "shared").string();
    for (const std::string& d : {root_ + "/alice/base", root_ + "/bob/export", shared_ + "/base"}) {
      std::filesystem::create_directories(d);
    }
    auto policy = PathPolicy::Create({.root = root_, .shared_read_roots = {shared_}});
    ASSERT_TRUE(policy.ok()) << policy.status();
    paths_ = *policy;
    Restart();
  }
  absl::Status Create(const std::string& tenant, const std::function<void(v1::JobSpec&)>& edit) {
    v1::CreateJobRequest r = Request(1);
    edit(*r.mutable_spec());
    return controller_->CreateJob(r, tenant).status();
  }
  std::string root_, shared_;
};

TEST_F(PathConfinementTest, JobSpecPathsMustBeTheTenantsOrShared) {
  struct Case {
    std::function<void(v1::JobSpec&)> edit;
    absl::StatusCode code;
    std::string message;  // expected prefix
  };
  const auto kDenied = absl::StatusCode::kPermissionDenied;
  const Case cases[] = {
      {[&](v1::JobSpec& s) { s.mutable_checkpoint()->set_directory(root_ + "/alice/run1"); }, absl::StatusCode::kOk, ""},
      {[&](v1::JobSpec& s) { s.mutable_model()->set_name(shared_ + "/base"); }, absl::StatusCode::kOk, ""},
      {[&](v1::JobSpec& s) { s.mutable_data()->set_path(shared_ + "/data.bin"); }, absl::StatusCode::kOk, ""},
      {[&](v1::JobSpec& s) { s.mutable_checkpoint()->set_directory(root_ + "/bob/run1"); }, kDenied,
       "spec.checkpoint.directory: \"" + root_ + "/bob/run1\" must be inside " + root_ +
           "/alice (the caller's tenant folder)"},
      {[&](v1::JobSpec& s) { s.mutable_checkpoint()->set_directory(shared_ + "/base/out"); }, kDenied,
       "spec.checkpoint.directory: "},
      {[&](v1::JobSpec& s) { s.mutable_model()->set_name(root_ + "/bob/export"); }, kDenied,
       "spec.model.name: \"" + root_ + "/bob/export\" must be under " + root_ + "/alice (the caller's tenant folder) or " +
           shared_ + " (shared, read-only)"},
      {[&](v1::JobSpec& s) { s.mutable_model()->set_name(root_ + "/alice/../bob/export"); }, kDenied, "spec.model.name: "},
      {[&](v1::JobSpec& s) { s.mutable_data()->set_path("/etc/passwd"); }, kDenied, "spec.data.path: \"/etc/passwd\""},
      {[&](v1::JobSpec& s) { s.mutable_data()->set_path("data.bin"); }, absl::StatusCode::kInvalidArgument,
       "spec.data.path: \"data.bin\" must be an absolute path"},
      {[&](v1::JobSpec& s) { s.mutable_model()->set_name("some-folder"); }, absl::StatusCode::kInvalidArgument,
       "spec.model.name: \"some-folder\" must be a named shape"},
  };
  for (const Case& c : cases) {
    const absl::Status s = Create("alice", c.edit);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), ::testing::StartsWith(c.message));
  }
  // Bob's own folder is his; the anonymous tenant (auth off) may use the whole root.
  EXPECT_TRUE(Create("bob", [&](v1::JobSpec& s) { s.mutable_model()->set_name(root_ + "/bob/export"); }).ok());
  EXPECT_TRUE(Create(kAnon, [&](v1::JobSpec& s) { s.mutable_model()->set_name(root_ + "/bob/export"); }).ok());
  EXPECT_EQ(Create(kAnon, [&](v1::JobSpec& s) { s.mutable_data()->set_path("/etc/passwd"); }).code(), kDenied);
}

TEST_F(PathConfinementTest, DefaultCheckpointsGoToTheTenantFolder) {
  auto w1 = Attach("w1");
  const v1::Job job = *controller_->CreateJob(Request(1), "alice");
  ASSERT_EQ(w1.conn->Assignments().size(), 1u);
  EXPECT_EQ(w1.conn->Assignments()[0].checkpoint_dir(), root_ + "/alice/checkpoints/job-" +
                                                             std::to_string(*ParseJobName(job.name())));
  EXPECT_EQ(controller_->DefaultCheckpointDir(7, kAnon), root_ + "/checkpoints/job-7");
}

TEST_F(PathConfinementTest, ALinkCannotSteerTheDefaultCheckpointFolder) {
  std::filesystem::create_directory_symlink(root_ + "/bob", root_ + "/alice/checkpoints");
  const absl::Status s = Create("alice", [](v1::JobSpec&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("resolves (through a symbolic link) outside"));
}

TEST_F(PathConfinementTest, JobsStoredBeforeThePathRootFailWhenTheyStart) {
  // Bob's job was accepted by a controller without --path-root; the store keeps it PENDING.
  paths_ = PathPolicy();
  Restart();
  v1::CreateJobRequest r = Request(1);
  r.mutable_spec()->mutable_model()->set_name(root_ + "/alice/base");
  const std::string stolen = controller_->CreateJob(r, "bob")->name();
  const std::string fine = controller_->CreateJob(Request(1), "bob")->name();
  // The controller restarts with --path-root: the job fails when it would start, and its
  // worker takes the next one.
  paths_ = *PathPolicy::Create({.root = root_, .shared_read_roots = {shared_}});
  Restart();
  auto w1 = Attach("w1");
  const v1::Job failed = *controller_->GetJob(*ParseJobName(stolen), "bob");
  EXPECT_EQ(failed.state(), v1::Job::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("refused when starting (--path-root): spec.model.name: "));
  EXPECT_EQ(controller_->GetJob(*ParseJobName(fine), "bob")->state(), v1::Job::RUNNING);
  ASSERT_EQ(w1.conn->Assignments().size(), 1u);
  EXPECT_EQ(w1.conn->Assignments()[0].job(), fine);
}

TEST_F(PathConfinementTest, TrainingCallDirectories) {
  auto call = [](int kind, const std::string& dir) {
    v1::TrainingCall c;
    if (kind == 0) c.mutable_save_checkpoint()->set_directory(dir);
    if (kind == 1) c.mutable_load_checkpoint()->set_directory(dir);
    if (kind == 2) c.mutable_export_weights()->set_directory(dir);
    return c;
  };
  const auto kDenied = absl::StatusCode::kPermissionDenied;
  EXPECT_TRUE(controller_->CheckPaths(call(0, ""), "bob").ok());  // the job's default folder
  EXPECT_TRUE(controller_->CheckPaths(call(0, root_ + "/bob/ckpt"), "bob").ok());
  EXPECT_TRUE(controller_->CheckPaths(call(1, root_ + "/bob/export"), "bob").ok());
  EXPECT_TRUE(controller_->CheckPaths(call(1, shared_ + "/base"), "bob").ok());
  EXPECT_TRUE(controller_->CheckPaths(call(2, root_ + "/bob/export"), "bob").ok());
  const absl::Status load = controller_->CheckPaths(call(1, root_ + "/alice/base"), "bob");
  EXPECT_EQ(load.code(), kDenied);
  EXPECT_THAT(std::string(load.message()), ::testing::StartsWith("directory: \"" + root_ + "/alice/base\" must be under " + root_ +
                                                    "/bob (the caller's tenant folder)"));
  EXPECT_EQ(controller_->CheckPaths(call(0, root_ + "/alice/x"), "bob").code(), kDenied);
  EXPECT_EQ(controller_->CheckPaths(call(2, shared_ + "/base"), "bob").code(), kDenied);
  EXPECT_EQ(controller_->CheckPaths(call(2, "relative"), "bob").code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ControllerTest, WithoutAPathRootAnyAbsolutePathIsAllowed) {
  v1::CreateJobRequest r = Request(1);
  r.mutable_spec()->mutable_checkpoint()->set_directory((dir_ / "anywhere").string());
  EXPECT_TRUE(controller_->CreateJob(r, "alice").ok());
  v1::TrainingCall c;
  c.mutable_load_checkpoint()->set_directory("/somewhere/else");
  EXPECT_TRUE(controller_->CheckPaths(c, "bob").ok());
  EXPECT_EQ(controller_->DefaultCheckpointDir(3, "alice"), (dir_ / "ckpt").string() + "/job-3");
}

TEST_F(ControllerTest, RequestIdsArePerTenant) {
  auto a1 = controller_->CreateJob(Request(1, 10, "same-id"), "alice");
  auto b1 = controller_->CreateJob(Request(1, 10, "same-id"), "bob");
  ASSERT_TRUE(a1.ok() && b1.ok());
  EXPECT_NE(a1->name(), b1->name());  // bob's retry key does not return alice's job
  EXPECT_EQ(b1->tenant(), "bob");
  // Bob may even send a different spec under the same id as alice.
  auto b2 = controller_->CreateJob(Request(1, 11, "other-id"), "bob");
  auto a2 = controller_->CreateJob(Request(1, 12, "other-id"), "alice");
  ASSERT_TRUE(a2.ok() && b2.ok());
  // Within a tenant the id is still idempotent, also across a restart.
  Restart();
  auto a3 = controller_->CreateJob(Request(1, 10, "same-id"), "alice");
  auto b3 = controller_->CreateJob(Request(1, 10, "same-id"), "bob");
  ASSERT_TRUE(a3.ok() && b3.ok());
  EXPECT_EQ(a3->name(), a1->name());
  EXPECT_EQ(b3->name(), b1->name());
  auto clash = controller_->CreateJob(Request(1, 13, "same-id"), "bob");
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(controller_->ListJobs({}, "alice")->jobs_size(), 2);
  EXPECT_EQ(controller_->ListJobs({}, "bob")->jobs_size(), 2);
}

// ---------------------------------------------------------------------------------------------
// TrainingService routing (Controller::Train) against a recording worker connection.

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

class TrainingRoutingTest : public ControllerTest {
 protected:
  virtual absl::Duration SequenceWait() const { return absl::Milliseconds(300); }
  void SetUp() override {
    sequence_wait_ = SequenceWait();
    ControllerTest::SetUp();
    v1::WorkerCapabilities caps;
    caps.set_worker_id("w1");
    caps.set_device("cpu");
    conn_ = std::make_shared<CallConnection>();
    session_ = *controller_->AttachWorker(caps, "127.0.0.1", conn_);
    v1::CreateJobRequest r = Request(1);
    r.mutable_spec()->set_kind(v1::RL_SESSION);
    r.mutable_spec()->clear_steps();
    r.mutable_spec()->mutable_data()->set_seq_len(8);
    r.mutable_spec()->mutable_data()->set_batch_size(2);  // 16 positions per call
    job_ = *controller_->CreateJob(r, kAnon);
    id_ = *ParseJobName(job_.name());
    ASSERT_EQ(Get(job_.name()).state(), v1::Job::RUNNING);
  }
  static v1::TrainingCall Fb(int tokens = 4) {
    v1::TrainingCall c;
    v1::Datum* d = c.mutable_forward_backward()->add_batch();
    for (int i = 0; i < tokens; ++i) {
      d->add_tokens(1);
      d->add_target_tokens(2);
    }
    c.mutable_forward_backward()->mutable_loss()->set_kind("cross_entropy");
    return c;
  }
  static v1::TrainingCall Step(double lr) {
    v1::TrainingCall c;
    c.mutable_optim_step()->mutable_adam()->set_lr(lr);
    return c;
  }
  void Reply(const v1::TrainingCall& call, const std::function<void(v1::TrainingReply&)>& fill = nullptr,
             int code = 0, const std::string& message = "") {
    v1::WorkerMessage m;
    v1::TrainingReply* r = m.mutable_reply();
    r->set_call_id(call.call_id());
    r->set_job(call.job());
    r->set_code(code);
    r->set_message(message);
    if (fill) fill(*r);
    controller_->OnWorkerMessage(session_, m);
  }
  std::string Metrics() { return prometheus::TextSerializer().Serialize(registry_->Collect()); }

  std::shared_ptr<CallConnection> conn_;
  int64_t session_ = 0;
  v1::Job job_;
  int64_t id_ = 0;
};

// Calls are forwarded in the order they reach the controller and each caller gets the reply
// with its own call_id, whatever order replies come in.
TEST_F(TrainingRoutingTest, ForwardsInArrivalOrderAndMatchesReplies) {
  AsyncTrain first(controller_.get(), id_, Fb(), 0);
  ASSERT_EQ(conn_->WaitForCalls(1).size(), 1u);
  AsyncTrain second(controller_.get(), id_, Step(0.5), 0);
  const std::vector<v1::TrainingCall> calls = conn_->WaitForCalls(2);
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_TRUE(calls[0].has_forward_backward());
  EXPECT_TRUE(calls[1].has_optim_step());
  EXPECT_EQ(calls[0].job(), job_.name());
  EXPECT_LT(calls[0].call_id(), calls[1].call_id());
  Reply(calls[1], [](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(1); });
  Reply(calls[0], [](v1::TrainingReply& r) { r.mutable_forward_backward()->set_loss(2.5); });
  auto a = first.Wait();
  auto b = second.Wait();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_DOUBLE_EQ(a->forward_backward().loss(), 2.5);
  EXPECT_EQ(b->optim_step().step(), 1);
}

// A worker's error reply reaches the caller with its code and message unchanged.
TEST_F(TrainingRoutingTest, WorkerErrorsPassThroughUnchanged) {
  AsyncTrain call(controller_.get(), id_, Fb(), 0);
  const auto calls = conn_->WaitForCalls(1);
  ASSERT_EQ(calls.size(), 1u);
  Reply(calls[0], nullptr, static_cast<int>(absl::StatusCode::kInvalidArgument),
        "batch[0].target_tokens[3] (300) must be in [0, 256)");
  auto r = call.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "batch[0].target_tokens[3] (300) must be in [0, 256)");
}

// sequence n is forwarded only after n - 1, whatever order the calls arrive in.
TEST_F(TrainingRoutingTest, SequencedCallsAreForwardedInSequenceOrder) {
  AsyncTrain third(controller_.get(), id_, Step(3), 3);
  AsyncTrain second(controller_.get(), id_, Step(2), 2);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (controller_->WaitingCalls(id_) < 2 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(controller_->WaitingCalls(id_), 2);
  EXPECT_EQ(conn_->WaitForCalls(0).size(), 0u);  // both wait for sequence 1
  AsyncTrain first(controller_.get(), id_, Step(1), 1);
  const auto calls = conn_->WaitForCalls(3);
  ASSERT_EQ(calls.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(calls[i].optim_step().adam().lr(), i + 1) << "position " << i;
    Reply(calls[i], [i](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(i + 1); });
  }
  EXPECT_EQ(first.Wait()->optim_step().step(), 1);
  EXPECT_EQ(second.Wait()->optim_step().step(), 2);
  EXPECT_EQ(third.Wait()->optim_step().step(), 3);
  // An old sequence is refused: ALREADY_EXISTS naming the field.
  auto again = controller_->Train(id_, Step(1), 2);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("sequence: 2 was already received"));
}

// A gap that does not fill within sequence_wait: ABORTED naming the sequence; the session
// keeps working (the missing call still goes through, then the aborted one can be retried).
TEST_F(TrainingRoutingTest, SequenceGapAborts) {
  auto r = controller_->Train(id_, Step(1), 2);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("sequence: call 2"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("for call 1"));
  EXPECT_EQ(controller_->WaitingCalls(id_), 0);
  EXPECT_TRUE(conn_->WaitForCalls(0).empty());
  AsyncTrain one(controller_.get(), id_, Step(1), 1);
  auto calls = conn_->WaitForCalls(1);
  ASSERT_EQ(calls.size(), 1u);
  Reply(calls[0], [](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(1); });
  EXPECT_TRUE(one.Wait().ok());
  AsyncTrain two(controller_.get(), id_, Step(1), 2);
  calls = conn_->WaitForCalls(2);
  ASSERT_EQ(calls.size(), 2u);
  Reply(calls[1], [](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(2); });
  EXPECT_EQ(two.Wait()->optim_step().step(), 2);
}

// A sequenced call refused before it reaches the worker (an edge rule, or a batch over the plan)
// is answered in its turn and uses up its number: the calls after it are not held back by a gap.
TEST_F(TrainingRoutingTest, ARefusedSequencedCallUsesUpItsNumber) {
  const absl::Status bad = absl::InvalidArgumentError("adam.lr: (-1) must be > 0 and finite");
  // Number 2 arrives first and waits for 1, which the edge refuses: 2 then goes through.
  AsyncTrain two(controller_.get(), id_, Step(1), 2);
  while (controller_->WaitingCalls(id_) == 0) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(controller_->RefuseInTurn(id_, 1, "OptimStep", bad), bad);
  auto calls = conn_->WaitForCalls(1);
  ASSERT_EQ(calls.size(), 1u);
  Reply(calls[0], [](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(1); });
  EXPECT_EQ(two.Wait()->optim_step().step(), 1);
  // A used number stays used, refused or not.
  EXPECT_EQ(controller_->RefuseInTurn(id_, 1, "OptimStep", bad).code(), absl::StatusCode::kAlreadyExists);
  // Number 3 is a batch over the plan (17 > 16 positions): refused in its turn, 4 is next.
  auto over = controller_->Train(id_, Fb(17), 3);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("batch: 17 token positions exceed"));
  AsyncTrain four(controller_.get(), id_, Fb(), 4);
  calls = conn_->WaitForCalls(2);
  ASSERT_EQ(calls.size(), 2u);
  Reply(calls[1], [](v1::TrainingReply& r) { r.mutable_forward_backward()->set_loss(1.5); });
  EXPECT_TRUE(four.Wait().ok());
  // Refusals count like other calls.
  EXPECT_THAT(Metrics(), HasSubstr("odyssey_training_calls_total{code=\"INVALID_ARGUMENT\",method=\"OptimStep\"}"));
}

// The worker's stream ending fails the pending calls with UNAVAILABLE instead of leaving them
// hanging; so does a cancel (ABORTED), and later calls get FAILED_PRECONDITION naming the state.
TEST_F(TrainingRoutingTest, DetachAndCancelFailPendingCalls) {
  AsyncTrain pending(controller_.get(), id_, Fb(), 0);
  ASSERT_EQ(conn_->WaitForCalls(1).size(), 1u);
  EXPECT_FALSE(pending.done());
  controller_->DetachWorker(session_);
  auto r = pending.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("worker w1 disconnected"));
  // While the worker is away: UNAVAILABLE at once; a sequenced call that was not forwarded
  // keeps its sequence for the retry.
  EXPECT_EQ(controller_->Train(id_, Fb(), 0).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(controller_->Train(id_, Fb(), 1).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(controller_->Train(id_, Fb(), 1).status().code(), absl::StatusCode::kUnavailable);

  // Back, then a cancel with a call pending.
  v1::WorkerCapabilities caps;
  caps.set_worker_id("w1");
  auto conn2 = std::make_shared<CallConnection>();
  session_ = *controller_->AttachWorker(caps, "127.0.0.1", conn2);
  AsyncTrain second(controller_.get(), id_, Fb(), 0);
  ASSERT_EQ(conn2->WaitForCalls(1).size(), 1u);
  ASSERT_TRUE(controller_->CancelJob(id_, kAnon).ok());
  r = second.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("CANCELLED"));
  r = controller_->Train(id_, Fb(), 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("is CANCELLED"));
}

TEST_F(TrainingRoutingTest, RefusesWhatItCannotServe) {
  auto r = controller_->Train(999, Fb(), 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("job: jobs/999 does not exist"));
  // An SFT job (PENDING: the only worker is busy with the session).
  auto sft = *controller_->CreateJob(Request(1), kAnon);
  r = controller_->Train(*ParseJobName(sft.name()), Fb(), 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("of kind SFT"));
  // A session waiting for a worker.
  v1::CreateJobRequest rl = Request(1);
  rl.mutable_spec()->set_kind(v1::RL_SESSION);
  auto waiting = *controller_->CreateJob(rl, kAnon);
  r = controller_->Train(*ParseJobName(waiting.name()), Fb(), 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("is PENDING"));
  // More positions than the plan (8 x 2 = 16): INVALID_ARGUMENT naming batch and the limit.
  v1::TrainingCall big = Fb(10);
  *big.mutable_forward_backward()->add_batch() = big.forward_backward().batch(0);
  r = controller_->Train(id_, big, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("batch: 20 token positions exceed the session's limit of 16"));
  EXPECT_TRUE(conn_->WaitForCalls(0).empty());
}

// Replies feed the job (SaveCheckpoint -> last_checkpoint, what a restart resumes from) and
// the metrics: mismatch gauges, optimizer step, calls by method and code.
TEST_F(TrainingRoutingTest, RepliesUpdateCheckpointAndMetrics) {
  {
    AsyncTrain fb(controller_.get(), id_, Fb(), 0);
    auto calls = conn_->WaitForCalls(1);
    Reply(calls.back(), [](v1::TrainingReply& r) {
      r.mutable_forward_backward()->set_mismatch_mean(0.125);
      r.mutable_forward_backward()->set_mismatch_max(0.5);
      r.mutable_forward_backward()->set_mismatch_tokens(4);
    });
    ASSERT_TRUE(fb.Wait().ok());
  }
  {
    AsyncTrain step(controller_.get(), id_, Step(1e-3), 0);
    auto calls = conn_->WaitForCalls(2);
    Reply(calls.back(), [](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(7); });
    ASSERT_TRUE(step.Wait().ok());
  }
  {
    v1::TrainingCall save;
    save.mutable_save_checkpoint();
    AsyncTrain call(controller_.get(), id_, save, 0);
    auto calls = conn_->WaitForCalls(3);
    Reply(calls.back(), [](v1::TrainingReply& r) {
      r.mutable_save_checkpoint()->set_directory("/ckpt/step-00000007");
      r.mutable_save_checkpoint()->set_step(7);
    });
    ASSERT_TRUE(call.Wait().ok());
  }
  controller_->CountTrainingCall("Forward", absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Get(job_.name()).last_checkpoint(), "/ckpt/step-00000007");
  const std::string m = Metrics();
  const std::string job = "job=\"" + job_.name() + "\"";
  EXPECT_THAT(m, HasSubstr("odyssey_rl_logprob_mismatch_mean{" + job + "} 0.125"));
  EXPECT_THAT(m, HasSubstr("odyssey_rl_logprob_mismatch_max{" + job + "} 0.5"));
  EXPECT_THAT(m, HasSubstr("odyssey_rl_optimizer_step{" + job + "} 7"));
  EXPECT_THAT(m, HasSubstr("odyssey_training_calls_total{code=\"OK\",method=\"ForwardBackward\"} 1"));
  EXPECT_THAT(m, HasSubstr("odyssey_training_calls_total{code=\"INVALID_ARGUMENT\",method=\"Forward\"} 1"));
  // A restart after losing the worker resumes from the saved checkpoint.
  controller_->DetachWorker(session_);
  now_ += absl::Seconds(11);
  controller_->Tick();
  EXPECT_EQ(Get(job_.name()).state(), v1::Job::FAILED);  // restart_limit 0
  // The job ended: its per-job gauges are gone.
  EXPECT_THAT(Metrics(), ::testing::Not(HasSubstr(job)));
}

TEST_F(TrainingRoutingTest, RestartResumesFromTheSavedCheckpoint) {
  controller_->CancelJob(id_, kAnon).IgnoreError();
  v1::CreateJobRequest r = Request(1);
  r.mutable_spec()->set_kind(v1::RL_SESSION);
  r.mutable_spec()->set_restart_limit(1);
  // w1 is still bound to the cancelled job until it reports its result.
  v1::WorkerMessage result;
  result.mutable_result()->set_job(job_.name());
  result.mutable_result()->set_cancelled("cancelled");
  controller_->OnWorkerMessage(session_, result);
  auto job = *controller_->CreateJob(r, kAnon);
  const int64_t id = *ParseJobName(job.name());
  ASSERT_EQ(Get(job.name()).state(), v1::Job::RUNNING);
  v1::TrainingCall save;
  save.mutable_save_checkpoint();
  AsyncTrain call(controller_.get(), id, save, 0);
  auto calls = conn_->WaitForCalls(1);
  Reply(calls.back(), [](v1::TrainingReply& r) {
    r.mutable_save_checkpoint()->set_directory("/ckpt/step-00000003");
    r.mutable_save_checkpoint()->set_step(3);
  });
  ASSERT_TRUE(call.Wait().ok());
  controller_->DetachWorker(session_);
  now_ += absl::Seconds(11);
  controller_->Tick();
  EXPECT_EQ(Get(job.name()).state(), v1::Job::PENDING);
  v1::WorkerCapabilities caps;
  caps.set_worker_id("w2");
  auto conn = std::make_shared<FakeConnection>();
  ASSERT_TRUE(controller_->AttachWorker(caps, "127.0.0.1", conn).ok());
  ASSERT_EQ(conn->Assignments().size(), 1u);
  EXPECT_EQ(conn->Assignments()[0].resume_from(), "/ckpt/step-00000003");
  EXPECT_EQ(Get(job.name()).state(), v1::Job::RUNNING);
}

// A sequenced call waiting for its turn ends as soon as the job does, not after sequence_wait.
class LongSequenceWaitTest : public TrainingRoutingTest {
 protected:
  absl::Duration SequenceWait() const override { return absl::Seconds(60); }
};

TEST_F(LongSequenceWaitTest, CancelEndsSequencedWaits) {
  AsyncTrain waiting(controller_.get(), id_, Step(1), 5);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (controller_->WaitingCalls(id_) < 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(controller_->WaitingCalls(id_), 1);
  const absl::Time cancelled = absl::Now();
  ASSERT_TRUE(controller_->CancelJob(id_, kAnon).ok());
  auto r = waiting.Wait();
  EXPECT_LT(absl::Now() - cancelled, absl::Seconds(5));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("is CANCELLED"));
  EXPECT_EQ(controller_->WaitingCalls(id_), 0);
}


// ---------------------------------------------------------------------------------------------
// Multi-rank RL sessions: Controller::Train over two recording worker connections.

v1::Datum MakeDatum(int tokens, float weight = 0) {
  v1::Datum d;
  for (int i = 0; i < tokens; ++i) {
    d.add_tokens(1);
    d.add_target_tokens(2);
    if (weight != 0) d.add_weights(weight);
  }
  return d;
}

class TrainingRanksTest : public ControllerTest {
 protected:
  void SetUp() override {
    ControllerTest::SetUp();
    for (const char* id : {"w1", "w2"}) {
      v1::WorkerCapabilities caps;
      caps.set_worker_id(id);
      caps.set_device("cpu");
      conns_.push_back(std::make_shared<CallConnection>());
      sessions_.push_back(*controller_->AttachWorker(caps, "127.0.0.1", conns_.back()));
    }
    v1::CreateJobRequest r = Request(2);
    r.mutable_spec()->set_kind(v1::RL_SESSION);
    r.mutable_spec()->clear_steps();
    r.mutable_spec()->mutable_data()->set_seq_len(8);
    r.mutable_spec()->mutable_data()->set_batch_size(2);  // 16 positions per rank, 32 per call
    job_ = *controller_->CreateJob(r, kAnon);
    id_ = *ParseJobName(job_.name());
    const v1::Job job = Get(job_.name());
    ASSERT_EQ(job.state(), v1::Job::RUNNING);
    ASSERT_EQ(job.workers_size(), 2);
    ASSERT_EQ(job.workers(0), "w1");  // rank 0 = conns_[0]
  }
  static v1::TrainingCall Fb(const std::vector<v1::Datum>& batch) {
    v1::TrainingCall c;
    for (const v1::Datum& d : batch) *c.mutable_forward_backward()->add_batch() = d;
    c.mutable_forward_backward()->mutable_loss()->set_kind("cross_entropy");
    return c;
  }
  static v1::TrainingCall Step(double lr) {
    v1::TrainingCall c;
    c.mutable_optim_step()->mutable_adam()->set_lr(lr);
    return c;
  }
  void Reply(int rank, const v1::TrainingCall& call, const std::function<void(v1::TrainingReply&)>& fill = nullptr,
             absl::StatusCode code = absl::StatusCode::kOk, const std::string& message = "") {
    v1::WorkerMessage m;
    v1::TrainingReply* r = m.mutable_reply();
    r->set_call_id(call.call_id());
    r->set_job(call.job());
    r->set_code(static_cast<int>(code));
    r->set_message(message);
    if (fill) fill(*r);
    controller_->OnWorkerMessage(sessions_[static_cast<size_t>(rank)], m);
  }
  // Logprobs of `n` tokens, each `value`.
  static void AddLogprobs(v1::TokenLogprobs* l, int n, float value) {
    for (int i = 0; i < n; ++i) l->add_values(value);
  }

  std::vector<std::shared_ptr<CallConnection>> conns_;
  std::vector<int64_t> sessions_;
  v1::Job job_;
  int64_t id_ = 0;
};

// ForwardBackward: each rank gets its token-balanced slice with its whole-batch offset and W of
// the whole batch; the reply merges the ranks' in datum order.
TEST_F(TrainingRanksTest, ForwardBackwardIsSplitAndMerged) {
  // 6 + 2 + 2 + 2 tokens: rank 0 runs datum 0, rank 1 datums 1..3. W = 6 x 0.5 + 6 x 1 = 9.
  AsyncTrain call(controller_.get(), id_, Fb({MakeDatum(6, 0.5f), MakeDatum(2), MakeDatum(2), MakeDatum(2)}), 0);
  const auto c0 = conns_[0]->WaitForCalls(1);
  const auto c1 = conns_[1]->WaitForCalls(1);
  ASSERT_EQ(c0.size(), 1u);
  ASSERT_EQ(c1.size(), 1u);
  ASSERT_EQ(c0[0].forward_backward().batch_size(), 1);
  ASSERT_EQ(c1[0].forward_backward().batch_size(), 3);
  EXPECT_EQ(c0[0].forward_backward().batch(0).tokens_size(), 6);
  EXPECT_EQ(c0[0].datum_offset(), 0);
  EXPECT_EQ(c1[0].datum_offset(), 1);
  EXPECT_DOUBLE_EQ(c0[0].weight_sum(), 9);
  EXPECT_DOUBLE_EQ(c1[0].weight_sum(), 9);
  EXPECT_EQ(c1[0].forward_backward().loss().kind(), "cross_entropy");
  EXPECT_EQ(c0[0].job(), job_.name());
  EXPECT_NE(c0[0].call_id(), c1[0].call_id());
  EXPECT_FALSE(call.done());
  // Replies in either order.
  Reply(1, c1[0], [](v1::TrainingReply& r) {
    auto* fb = r.mutable_forward_backward();
    for (int d = 0; d < 3; ++d) AddLogprobs(fb->add_logprobs(), 2, -1.0f - d);
    fb->set_loss(0.5);
    fb->set_weight_sum(9);
    fb->set_mismatch_mean(0.375);
    fb->set_mismatch_max(0.9);
    fb->set_mismatch_tokens(6);
    fb->set_clipped_tokens(1);
    fb->set_tokens(6);
    fb->set_seconds(2.0);
  });
  EXPECT_FALSE(call.done());  // rank 0 still runs
  Reply(0, c0[0], [](v1::TrainingReply& r) {
    auto* fb = r.mutable_forward_backward();
    AddLogprobs(fb->add_logprobs(), 6, -0.5f);
    fb->set_loss(1.25);
    fb->set_weight_sum(9);
    fb->set_mismatch_mean(0.125);
    fb->set_mismatch_max(0.2);
    fb->set_mismatch_tokens(2);
    fb->set_clipped_tokens(2);
    fb->set_tokens(6);
    fb->set_seconds(3.0);
  });
  auto r = call.Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::ForwardBackwardResponse& fb = r->forward_backward();
  ASSERT_EQ(fb.logprobs_size(), 4);
  EXPECT_EQ(fb.logprobs(0).values_size(), 6);
  EXPECT_FLOAT_EQ(fb.logprobs(0).values(0), -0.5f);
  EXPECT_FLOAT_EQ(fb.logprobs(1).values(0), -1.0f);
  EXPECT_FLOAT_EQ(fb.logprobs(3).values(1), -3.0f);
  EXPECT_DOUBLE_EQ(fb.loss(), 1.75);
  EXPECT_DOUBLE_EQ(fb.weight_sum(), 9);
  EXPECT_EQ(fb.mismatch_tokens(), 8);
  EXPECT_DOUBLE_EQ(fb.mismatch_mean(), (0.125 * 2 + 0.375 * 6) / 8);
  EXPECT_DOUBLE_EQ(fb.mismatch_max(), 0.9);
  // The controller's mismatch gauges show the merged figures, not one rank's.
  const std::string m = prometheus::TextSerializer().Serialize(registry_->Collect());
  EXPECT_THAT(m, HasSubstr("odyssey_rl_logprob_mismatch_mean{job=\"" + job_.name() + "\"} 0.3125"));
  EXPECT_THAT(m, HasSubstr("odyssey_rl_logprob_mismatch_max{job=\"" + job_.name() + "\"} 0.9"));
  // The job's loss is the batch's, also after rank 0 reports progress with its share.
  EXPECT_DOUBLE_EQ(Get(job_.name()).loss(), 1.75);
  v1::WorkerMessage progress;
  progress.mutable_progress()->set_job(job_.name());
  progress.mutable_progress()->set_rank(0);
  progress.mutable_progress()->mutable_metrics()->set_step(1);
  progress.mutable_progress()->mutable_metrics()->set_loss(1.25);
  controller_->OnWorkerMessage(sessions_[0], progress);
  EXPECT_EQ(Get(job_.name()).step(), 1);
  EXPECT_DOUBLE_EQ(Get(job_.name()).loss(), 1.75);
  // Positions count every rank's, once (from the merged reply, not rank 0's progress).
  progress.mutable_progress()->mutable_metrics()->set_tokens(6);
  controller_->OnWorkerMessage(sessions_[0], progress);
  EXPECT_THAT(prometheus::TextSerializer().Serialize(registry_->Collect()), HasSubstr("odyssey_tokens_total 12"));
  EXPECT_EQ(fb.clipped_tokens(), 3);
  EXPECT_EQ(fb.tokens(), 12);
  EXPECT_DOUBLE_EQ(fb.seconds(), 3.0);
}

// Fewer datums than ranks: rank 1 gets an empty slice (it still joins the engine's collectives).
TEST_F(TrainingRanksTest, ForwardGivesAnEmptySliceWhenDatumsRunOut) {
  v1::TrainingCall c;
  *c.mutable_forward()->add_batch() = MakeDatum(5);
  AsyncTrain call(controller_.get(), id_, c, 0);
  const auto c0 = conns_[0]->WaitForCalls(1);
  const auto c1 = conns_[1]->WaitForCalls(1);
  ASSERT_EQ(c0.size(), 1u);
  ASSERT_EQ(c1.size(), 1u);
  ASSERT_TRUE(c1[0].has_forward());
  EXPECT_EQ(c0[0].forward().batch_size(), 1);
  EXPECT_EQ(c1[0].forward().batch_size(), 0);
  EXPECT_EQ(c1[0].datum_offset(), 1);
  EXPECT_EQ(c0[0].weight_sum(), 0);  // forward has no loss
  Reply(0, c0[0], [](v1::TrainingReply& r) { AddLogprobs(r.mutable_forward()->add_logprobs(), 5, -2.0f); });
  Reply(1, c1[0], [](v1::TrainingReply& r) { r.mutable_forward(); });
  auto r = call.Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->forward().logprobs_size(), 1);
  EXPECT_EQ(r->forward().logprobs(0).values_size(), 5);
}

// Concurrent calls reach both ranks' streams in the same order (the collectives pair them up).
TEST_F(TrainingRanksTest, EveryRankSeesTheCallsInTheSameOrder) {
  std::vector<std::unique_ptr<AsyncTrain>> calls;
  for (int i = 1; i <= 8; ++i) calls.push_back(std::make_unique<AsyncTrain>(controller_.get(), id_, Step(i), 0));
  const auto c0 = conns_[0]->WaitForCalls(8);
  const auto c1 = conns_[1]->WaitForCalls(8);
  ASSERT_EQ(c0.size(), 8u);
  ASSERT_EQ(c1.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(c0[i].optim_step().adam().lr(), c1[i].optim_step().adam().lr()) << i;
    Reply(0, c0[i], [](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(7); });
    Reply(1, c1[i], [](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(7); });
  }
  for (auto& c : calls) {
    auto r = c->Wait();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->optim_step().step(), 7);
  }
}

// SaveCheckpoint and ExportWeights go to rank 0 only; LoadCheckpoint to every rank.
TEST_F(TrainingRanksTest, SaveAndExportGoToRankZeroOnly) {
  v1::TrainingCall save;
  save.mutable_save_checkpoint()->set_directory("/ckpt/a");
  AsyncTrain saving(controller_.get(), id_, save, 0);
  auto c0 = conns_[0]->WaitForCalls(1);
  ASSERT_EQ(c0.size(), 1u);
  Reply(0, c0[0], [](v1::TrainingReply& r) {
    r.mutable_save_checkpoint()->set_directory("/ckpt/a");
    r.mutable_save_checkpoint()->set_step(3);
  });
  auto r = saving.Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->save_checkpoint().step(), 3);
  EXPECT_EQ(Get(job_.name()).last_checkpoint(), "/ckpt/a");  // what a restart resumes from

  v1::TrainingCall exp;
  exp.mutable_export_weights()->set_directory("/export/a");
  AsyncTrain exporting(controller_.get(), id_, exp, 0);
  c0 = conns_[0]->WaitForCalls(2);
  ASSERT_EQ(c0.size(), 2u);
  ASSERT_TRUE(c0[1].has_export_weights());
  Reply(0, c0[1], [](v1::TrainingReply& r) { r.mutable_export_weights()->set_directory("/export/a"); });
  ASSERT_TRUE(exporting.Wait().ok());

  v1::TrainingCall load;
  load.mutable_load_checkpoint()->set_directory("/ckpt/a");
  AsyncTrain loading(controller_.get(), id_, load, 0);
  c0 = conns_[0]->WaitForCalls(3);
  const auto c1 = conns_[1]->WaitForCalls(1);
  ASSERT_EQ(c0.size(), 3u);
  ASSERT_EQ(c1.size(), 1u);  // neither the save nor the export reached rank 1
  ASSERT_TRUE(c1[0].has_load_checkpoint());
  Reply(1, c1[0], [](v1::TrainingReply& r) { r.mutable_load_checkpoint()->set_step(3); });
  Reply(0, c0[2], [](v1::TrainingReply& r) { r.mutable_load_checkpoint()->set_step(3); });
  r = loading.Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->load_checkpoint().step(), 3);
}

// A failed call comes back with the rank's own error, not another rank's echo of it, whichever
// rank holds it; with only echoes, the first in rank order.
TEST_F(TrainingRanksTest, TheSpecificErrorWins) {
  AsyncTrain bad(controller_.get(), id_, Fb({MakeDatum(4), MakeDatum(4), MakeDatum(4), MakeDatum(4)}), 0);
  auto c0 = conns_[0]->WaitForCalls(1);
  auto c1 = conns_[1]->WaitForCalls(1);
  ASSERT_EQ(c1.size(), 1u);
  EXPECT_EQ(c1[0].datum_offset(), 2);
  Reply(0, c0[0], nullptr, absl::StatusCode::kInvalidArgument,
        "batch: refused on another rank (its slice of the batch is invalid); nothing ran");
  Reply(1, c1[0], nullptr, absl::StatusCode::kInvalidArgument, "batch[3].target_tokens[1] (999) must be in [0, 256)");
  auto r = bad.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "batch[3].target_tokens[1] (999) must be in [0, 256)");

  AsyncTrain step(controller_.get(), id_, Step(1), 0);
  c0 = conns_[0]->WaitForCalls(2);
  c1 = conns_[1]->WaitForCalls(2);
  ASSERT_EQ(c1.size(), 2u);
  Reply(0, c0[1], nullptr, absl::StatusCode::kInternal, "optim_step failed on another rank; gradients dropped");
  Reply(1, c1[1], nullptr, absl::StatusCode::kInternal, "optim_step failed on another rank; gradients dropped");
  r = step.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("on another rank"));

  // One rank OK, the other not: the error.
  AsyncTrain step2(controller_.get(), id_, Step(1), 0);
  c0 = conns_[0]->WaitForCalls(3);
  c1 = conns_[1]->WaitForCalls(3);
  ASSERT_EQ(c1.size(), 3u);
  Reply(0, c0[2], [](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(1); });
  Reply(1, c1[2], nullptr, absl::StatusCode::kFailedPrecondition, "no gradients");
  r = step2.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
}

// The batch limit is per rank: the whole batch may hold 2 x 16 positions, no slice more than 16.
TEST_F(TrainingRanksTest, BatchLimitIsPerRank) {
  auto r = controller_->Train(id_, Fb({MakeDatum(16), MakeDatum(16), MakeDatum(1)}), 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("33 token positions exceed the session's limit of 32"));
  r = controller_->Train(id_, Fb({MakeDatum(20), MakeDatum(2)}), 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("rank 0's slice (batch[0..0]) holds 20 token positions"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("per-rank limit of 16"));
  EXPECT_EQ(conns_[0]->WaitForCalls(0).size(), 0u);  // nothing was forwarded
  // 32 positions, 16 per rank: forwarded.
  AsyncTrain ok(controller_.get(), id_, Fb({MakeDatum(16), MakeDatum(16)}), 0);
  ASSERT_EQ(conns_[1]->WaitForCalls(1).size(), 1u);
  ASSERT_EQ(conns_[0]->WaitForCalls(1).size(), 1u);
  Reply(0, conns_[0]->WaitForCalls(1)[0], [](v1::TrainingReply& r) { r.mutable_forward_backward()->set_loss(1); });
  Reply(1, conns_[1]->WaitForCalls(1)[0], [](v1::TrainingReply& r) { r.mutable_forward_backward()->set_loss(1); });
  ASSERT_TRUE(ok.Wait().ok());
}

// Rank 1's stream ending fails the pending call at once (rank 0's reply no longer matters);
// while it is away, calls get UNAVAILABLE naming it.
TEST_F(TrainingRanksTest, DetachOfAnyRankFailsThePendingCall) {
  AsyncTrain pending(controller_.get(), id_, Fb({MakeDatum(4), MakeDatum(4)}), 0);
  const auto c0 = conns_[0]->WaitForCalls(1);
  ASSERT_EQ(conns_[1]->WaitForCalls(1).size(), 1u);
  controller_->DetachWorker(sessions_[1]);
  auto r = pending.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("worker w2 disconnected"));
  Reply(0, c0[0], [](v1::TrainingReply& r) { r.mutable_forward_backward()->set_loss(1); });  // late: ignored
  r = controller_->Train(id_, Step(1), 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("rank 1"));
  EXPECT_EQ(conns_[0]->WaitForCalls(0).size(), 1u);  // not forwarded to rank 0 either
}


// Sequences order a multi-rank session's calls on every rank; a cancel aborts a call pending on
// both ranks.
TEST_F(TrainingRanksTest, SequencesAndCancelSpanTheRanks) {
  AsyncTrain second(controller_.get(), id_, Step(2), 2);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (controller_->WaitingCalls(id_) < 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(controller_->WaitingCalls(id_), 1);
  AsyncTrain first(controller_.get(), id_, Step(1), 1);
  for (const auto& conn : conns_) {
    const auto calls = conn->WaitForCalls(2);
    ASSERT_EQ(calls.size(), 2u);
    EXPECT_EQ(calls[0].optim_step().adam().lr(), 1);
    EXPECT_EQ(calls[1].optim_step().adam().lr(), 2);
  }
  for (int rank = 0; rank < 2; ++rank) {
    const auto calls = conns_[static_cast<size_t>(rank)]->WaitForCalls(2);
    for (int i = 0; i < 2; ++i)
      Reply(rank, calls[static_cast<size_t>(i)], [i](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(i + 1); });
  }
  ASSERT_EQ(first.Wait()->optim_step().step(), 1);
  ASSERT_EQ(second.Wait()->optim_step().step(), 2);

  AsyncTrain pending(controller_.get(), id_, Fb({MakeDatum(4), MakeDatum(4)}), 0);
  const auto c0 = conns_[0]->WaitForCalls(3);
  ASSERT_EQ(conns_[1]->WaitForCalls(3).size(), 3u);
  Reply(0, c0[2], [](v1::TrainingReply& r) { r.mutable_forward_backward()->set_loss(1); });  // rank 1 still runs
  ASSERT_TRUE(controller_->CancelJob(id_, kAnon).ok());
  auto r = pending.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("CANCELLED"));
}


}  // namespace
}  // namespace odyssey::server
