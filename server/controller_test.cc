#include "server/controller.h"

#include <filesystem>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
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
    options.registry = std::make_shared<prometheus::Registry>();
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

}  // namespace
}  // namespace odyssey::server
