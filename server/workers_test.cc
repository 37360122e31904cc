// The worker registry (workers.cc): a lost worker restarts its job from the last checkpoint
// up to restart_limit, a failed rank fails its job and cancels the others, and after a
// controller restart RUNNING jobs wait for their workers to re-attach.
#include "server/controller.h"

#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/controller_fixture.h"
#include "server/validation.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;
using ::testing::HasSubstr;
using testing::ControllerTest;
using testing::kAnon;

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

// A rank whose ranks did not meet (its rendezvous port taken): the job runs again on another
// port, kRendezvousRetryLimit times, without counting restarts (restart_limit 0 here), and then
// FAILS naming it; the other rank is told to stop each time. A plain rank error still fails it.
TEST_F(ControllerTest, RanksThatDidNotMeetRunAgainOnAnotherPort) {
  auto w1 = Attach("w1"), w2 = Attach("w2");
  auto job = *controller_->CreateJob(Request(2), kAnon);
  auto did_not_meet = [&](const Attached& w, int rank) {
    v1::WorkerMessage m;
    m.mutable_result()->set_job(job.name());
    m.mutable_result()->set_rank(rank);
    m.mutable_result()->set_error("rendezvous 127.0.0.1:29501: bind/listen: Address already in use");
    m.mutable_result()->set_rendezvous_failed(true);
    controller_->OnWorkerMessage(w.session, m);
  };
  std::vector<std::string> ports;
  for (int attempt = 0; attempt <= kRendezvousRetryLimit; ++attempt) {
    const v1::Job running = Get(job.name());
    ASSERT_EQ(running.state(), v1::Job::RUNNING) << "attempt " << attempt << ": " << running.error();
    ASSERT_EQ(running.workers_size(), 2);
    Attached& rank0 = running.workers(0) == "w1" ? w1 : w2;
    Attached& rank1 = running.workers(0) == "w1" ? w2 : w1;
    const v1::Assignment a = rank0.conn->Assignments().back();
    EXPECT_EQ(a.rendezvous(), rank1.conn->Assignments().back().rendezvous());
    ports.push_back(a.rendezvous());
    const int cancels = rank1.conn->Count(v1::ControllerMessage::kCancel);
    did_not_meet(rank0, 0);
    EXPECT_EQ(rank1.conn->Count(v1::ControllerMessage::kCancel), cancels + 1) << "attempt " << attempt;
    const v1::Job after = Get(job.name());
    EXPECT_EQ(after.restarts(), 0);
    if (attempt < kRendezvousRetryLimit) {
      EXPECT_EQ(after.state(), v1::Job::PENDING) << after.error();
      EXPECT_EQ(after.rendezvous_retries(), attempt + 1);
      Result(rank1, job.name(), 1, false, "told to stop");  // rank 1 stops: both idle, it runs again
    } else {
      EXPECT_EQ(after.state(), v1::Job::FAILED);
      EXPECT_THAT(after.error(), HasSubstr("bind/listen: Address already in use"));
      EXPECT_THAT(after.error(), HasSubstr("the ranks did not meet in 4 attempts"));
    }
  }
  ASSERT_EQ(ports.size(), 4u);
  EXPECT_EQ(ports[0], "127.0.0.1:29501");  // base + id on the first attempt
  for (size_t i = 0; i < ports.size(); ++i)
    for (size_t j = i + 1; j < ports.size(); ++j) EXPECT_NE(ports[i], ports[j]) << i << " " << j;

  auto other = *controller_->CreateJob(Request(1), kAnon);
  ASSERT_EQ(Get(other.name()).state(), v1::Job::RUNNING);
  const v1::Job placed = Get(other.name());
  Result(placed.workers(0) == "w1" ? w1 : w2, other.name(), 0, false);  // "boom", not the rendezvous
  EXPECT_EQ(Get(other.name()).state(), v1::Job::FAILED);
  EXPECT_EQ(Get(other.name()).rendezvous_retries(), 0);
}

// A worker that shuts down (SIGTERM) stops its run and says so (worker_leaving): the job is not
// at fault and restarts from its newest checkpoint on another worker, as for a lost worker,
// without waiting for the heartbeat timeout; the leaving worker gets nothing more until a new
// process attaches under its id. Out of restarts, the job FAILS naming the shutdown.
TEST_F(ControllerTest, AWorkerThatLeavesRestartsItsJobAndGetsNoMoreWork) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1, 10, "", 0, /*restart_limit=*/1), kAnon);
  ASSERT_EQ(Get(job.name()).workers(0), "w1");
  Progress(w1, job.name(), 0, 4, "/ckpt/step-4");
  auto w2 = Attach("w2");
  auto leaving = [&](const Attached& w, const std::string& name) {
    v1::WorkerMessage m;
    m.mutable_result()->set_job(name);
    m.mutable_result()->set_rank(0);
    m.mutable_result()->set_cancelled("the worker is shutting down");
    m.mutable_result()->set_worker_leaving(true);
    controller_->OnWorkerMessage(w.session, m);
  };
  leaving(w1, job.name());  // no clock advance: not a heartbeat timeout
  const v1::Job moved = Get(job.name());
  EXPECT_EQ(moved.state(), v1::Job::RUNNING);
  EXPECT_EQ(moved.restarts(), 1);
  ASSERT_EQ(moved.workers_size(), 1);
  EXPECT_EQ(moved.workers(0), "w2");
  ASSERT_EQ(w2.conn->Assignments().size(), 1u);
  EXPECT_EQ(w2.conn->Assignments()[0].resume_from(), "/ckpt/step-4");
  for (const WorkerInfo& info : controller_->Workers()) {
    if (info.id == "w1") {
      EXPECT_EQ(info.state, "leaving");
    }
  }

  // w1 is still attached but gets nothing: the next job waits for an idle worker.
  auto next = *controller_->CreateJob(Request(1), kAnon);
  EXPECT_EQ(Get(next.name()).state(), v1::Job::PENDING);
  EXPECT_EQ(w1.conn->Assignments().size(), 1u);

  // The job's second shutdown is past its restart_limit of 1.
  leaving(w2, job.name());
  const v1::Job failed = Get(job.name());
  EXPECT_EQ(failed.state(), v1::Job::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("worker w2 (rank 0) is shutting down; restart_limit (1) reached"));

  // A new w1 process attaches: it is idle again and takes the waiting job.
  controller_->DetachWorker(w1.session);
  auto again = Attach("w1");
  EXPECT_EQ(Get(next.name()).state(), v1::Job::RUNNING);
  EXPECT_EQ(again.conn->Assignments().size(), 1u);
}

// The rendezvous port: base + id first, moved on every later attempt (restarts and rendezvous
// retries alike), within [base, base + 10000), not repeating for 10000 attempts.
TEST(RendezvousPortTest, MovesWithEveryAttempt) {
  EXPECT_EQ(RendezvousPort(29500, 7, 0), 29507);
  std::set<int> seen;
  for (int attempt = 0; attempt < 10000; ++attempt) {
    const int port = RendezvousPort(29500, 7, attempt);
    EXPECT_GE(port, 29500);
    EXPECT_LT(port, 39500);
    seen.insert(port);
  }
  EXPECT_EQ(seen.size(), 10000u);
  EXPECT_EQ(RendezvousPort(29500, 10007, 0), 29507);
  // Near the top of the port range the window shrinks to what is left below 65536 and every
  // port of it still comes once (a base of 60000 gave 65566 on a restart before).
  for (const int base : {55537, 60000, 65530, 65535}) {
    const int window = 65536 - base;
    std::set<int> near_top;
    for (int attempt = 0; attempt < window; ++attempt) {
      const int port = RendezvousPort(base, 7, attempt);
      EXPECT_GE(port, base) << base;
      EXPECT_LE(port, 65535) << base;
      near_top.insert(port);
    }
    EXPECT_EQ(near_top.size(), static_cast<size_t>(window)) << base;
  }
}

TEST_F(ControllerTest, ControllerRestartKeepsRunningJobForReattachingWorker) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1), kAnon);
  Progress(w1, job.name(), 0, 3);
  Restart();
  EXPECT_EQ(Get(job.name()).state(), v1::Job::RUNNING);
  EXPECT_EQ(Get(job.name()).step(), 3);
  auto again = Attach("w1", "127.0.0.1", /*send_held=*/false);
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
  auto w2b = Attach("w2", "127.0.0.1", /*send_held=*/false);
  v1::WorkerMessage held;
  held.mutable_held();
  controller_->OnWorkerMessage(w2b.session, held);
  // Lost, restarted, and immediately placed on w2 again (it is idle now).
  EXPECT_EQ(Get(job.name()).restarts(), 2);
  EXPECT_EQ(Get(job.name()).state(), v1::Job::RUNNING);
  EXPECT_EQ(w2b.conn->Assignments().size(), 1u);
}


// A job that wrote several checkpoints resumes from the newest one, whichever way it is lost:
// a worker that times out, a rank of a gang whose worker dies, and after a controller restart
// (the job's last_checkpoint is persisted). Guards against resuming from a stale (first)
// checkpoint, which still trains but silently repeats steps.
TEST_F(ControllerTest, LostJobResumesFromItsNewestCheckpoint) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1, 100, "", 0, /*restart_limit=*/3), kAnon);
  Progress(w1, job.name(), 0, 2, "/ckpt/step-2");
  Progress(w1, job.name(), 0, 4, "/ckpt/step-4");
  Progress(w1, job.name(), 0, 6);  // a step without a checkpoint changes nothing
  Progress(w1, job.name(), 0, 8, "/ckpt/step-8");
  EXPECT_EQ(Get(job.name()).last_checkpoint(), "/ckpt/step-8");
  controller_->DetachWorker(w1.session);
  now_ += absl::Seconds(11);
  controller_->Tick();
  ASSERT_EQ(Get(job.name()).state(), v1::Job::PENDING);

  auto w2 = Attach("w2");
  ASSERT_EQ(w2.conn->Assignments().size(), 1u);
  EXPECT_EQ(w2.conn->Assignments()[0].resume_from(), "/ckpt/step-8");
  // The resumed run writes newer checkpoints; a controller restart keeps the newest.
  Progress(w2, job.name(), 0, 10, "/ckpt/step-10");
  Progress(w2, job.name(), 0, 12, "/ckpt/step-12");
  Restart();
  EXPECT_EQ(Get(job.name()).last_checkpoint(), "/ckpt/step-12");
  now_ += absl::Seconds(11);  // w2 never re-attaches: lost
  controller_->Tick();
  ASSERT_EQ(Get(job.name()).state(), v1::Job::PENDING);
  auto w3 = Attach("w3");
  ASSERT_EQ(w3.conn->Assignments().size(), 1u);
  EXPECT_EQ(w3.conn->Assignments()[0].resume_from(), "/ckpt/step-12");
}

// One rank of a 2-rank job is lost: every rank of the restarted gang resumes from the newest
// checkpoint rank 0 reported (not from scratch, not from an older one).
TEST_F(ControllerTest, LostRankRestartsTheGangFromTheNewestCheckpoint) {
  auto w1 = Attach("w1"), w2 = Attach("w2"), spare = Attach("w3");
  auto job = *controller_->CreateJob(Request(2, 100, "", 0, /*restart_limit=*/1), kAnon);
  const v1::Job running = Get(job.name());
  ASSERT_EQ(running.workers_size(), 2);
  Attached* rank0 = running.workers(0) == "w1" ? &w1 : running.workers(0) == "w2" ? &w2 : &spare;
  Attached* rank1 = running.workers(1) == "w1" ? &w1 : running.workers(1) == "w2" ? &w2 : &spare;
  Progress(*rank0, job.name(), 0, 5, "/ckpt/step-5");
  Progress(*rank1, job.name(), 1, 5);  // a rank > 0 never sets the checkpoint
  Progress(*rank0, job.name(), 0, 10, "/ckpt/step-10");
  controller_->DetachWorker(rank1->session);
  auto heartbeat = [&](const Attached& w) {
    v1::WorkerMessage m;
    m.mutable_heartbeat();
    controller_->OnWorkerMessage(w.session, m);
  };
  now_ += absl::Seconds(6);  // the survivor and the spare stay alive; rank 1 stays away
  for (Attached* w : {&w1, &w2, &spare}) {
    if (w != rank1) heartbeat(*w);
  }
  now_ += absl::Seconds(5);
  controller_->Tick();
  // The survivor is told to stop; once it reports that, the gang is placed again.
  EXPECT_GE(rank0->conn->Count(v1::ControllerMessage::kCancel), 1);
  Result(*rank0, job.name(), 0, false, "cancelled by the controller");
  std::vector<v1::Assignment> restarted;
  for (Attached* w : {&w1, &w2, &spare}) {
    if (w == rank1) continue;
    for (const v1::Assignment& a : w->conn->Assignments()) {
      if (a.job() == job.name() && !a.resume_from().empty()) restarted.push_back(a);  // not the first run
    }
  }
  ASSERT_EQ(Get(job.name()).state(), v1::Job::RUNNING) << Get(job.name()).error();
  ASSERT_EQ(restarted.size(), 2u);
  for (const v1::Assignment& a : restarted) EXPECT_EQ(a.resume_from(), "/ckpt/step-10") << "rank " << a.rank();
}

// A second process with a live worker's id is refused; it never takes over the first one's job.
TEST_F(ControllerTest, ASecondAttachWithALiveWorkersIdIsRefused) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1), kAnon);
  ASSERT_EQ(Get(job.name()).state(), v1::Job::RUNNING);
  v1::WorkerCapabilities caps;
  caps.set_worker_id("w1");
  auto intruder = std::make_shared<odyssey::server::testing::FakeConnection>();
  absl::StatusOr<int64_t> s = controller_->AttachWorker(caps, "10.0.0.9", intruder);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(s.status().message(), HasSubstr("hello.worker_id: \"w1\" is attached on a live stream (from 127.0.0.1"));
  EXPECT_FALSE(w1.conn->closed);
  EXPECT_EQ(Get(job.name()).state(), v1::Job::RUNNING);
  Progress(w1, job.name(), 0, 2);  // the first stream still counts
  EXPECT_EQ(Get(job.name()).step(), 2);
  // Once that stream is gone, the id may attach again (and reconcile through `held`).
  controller_->DetachWorker(w1.session);
  auto back = Attach("w1", "127.0.0.1", /*send_held=*/false);
  EXPECT_NE(back.session, 0);
}

// A worker silent past the heartbeat limit is dead and its job restarted; when it comes back
// still running that job, it is told to stop and gets nothing until it has (it used to get the
// next assignments at once, and refuse them all as busy: FAILED).
TEST_F(ControllerTest, AReturningWorkerStillRunningALostJobGetsNothingUntilItStops) {
  auto w1 = Attach("w1");
  auto lost = *controller_->CreateJob(Request(1, 10, "", 0, /*restart_limit=*/2), kAnon);
  Progress(w1, lost.name(), 0, 4, "/ckpt/step-4");
  now_ += absl::Seconds(11);  // SIGSTOP: no heartbeat
  controller_->Tick();
  ASSERT_EQ(Get(lost.name()).state(), v1::Job::PENDING);
  EXPECT_TRUE(w1.conn->closed);
  auto next = *controller_->CreateJob(Request(1), kAnon);

  auto back = Attach("w1", "127.0.0.1", /*send_held=*/false);
  EXPECT_EQ(controller_->Workers()[0].state, "returning");
  EXPECT_EQ(back.conn->Assignments().size(), 0u);  // nothing before its held is read
  v1::WorkerMessage held;
  held.mutable_held()->add_jobs(lost.name());
  controller_->OnWorkerMessage(back.session, held);
  EXPECT_EQ(back.conn->Count(v1::ControllerMessage::kCancel), 1);
  EXPECT_EQ(controller_->Workers()[0].state, "stopping");
  EXPECT_EQ(back.conn->Assignments().size(), 0u);
  controller_->Tick();
  EXPECT_EQ(back.conn->Assignments().size(), 0u);
  EXPECT_EQ(Get(next.name()).state(), v1::Job::PENDING);

  // It stops (its result for the lost run is ignored), and is idle: the queue head (the lost
  // job's restart, from its checkpoint) starts on it.
  Result(back, lost.name(), 0, false, "cancelled by the controller");
  EXPECT_EQ(Get(lost.name()).state(), v1::Job::RUNNING);
  ASSERT_EQ(back.conn->Assignments().size(), 1u);
  EXPECT_EQ(back.conn->Assignments()[0].job(), lost.name());
  EXPECT_EQ(back.conn->Assignments()[0].resume_from(), "/ckpt/step-4");
  EXPECT_EQ(Get(next.name()).state(), v1::Job::PENDING);
  EXPECT_EQ(Get(lost.name()).restarts(), 1);
}

// A job cancelled while its worker was away (the cancel never reached it) still runs there when
// the worker comes back: it is told to stop and gets nothing until it has (it used to count as
// idle at once, and refuse the next assignments as busy: FAILED; the soak's seed 3816).
TEST_F(ControllerTest, AReturningWorkerStillRunningAJobCancelledWhileAwayGetsNothingUntilItStops) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1), kAnon);
  controller_->DetachWorker(w1.session);
  ASSERT_TRUE(controller_->CancelJob(*ParseJobName(job.name()), "").ok());
  ASSERT_EQ(Get(job.name()).state(), v1::Job::CANCELLED);
  auto next = *controller_->CreateJob(Request(1), kAnon);

  auto back = Attach("w1", "127.0.0.1", /*send_held=*/false);
  v1::WorkerMessage held;
  held.mutable_held()->add_jobs(job.name());
  controller_->OnWorkerMessage(back.session, held);
  EXPECT_EQ(back.conn->Count(v1::ControllerMessage::kCancel), 1);
  EXPECT_EQ(controller_->Workers()[0].state, "stopping");
  EXPECT_EQ(back.conn->Assignments().size(), 0u);
  EXPECT_EQ(Get(next.name()).state(), v1::Job::PENDING);

  Result(back, job.name(), 0, false, "cancelled by the controller");
  EXPECT_EQ(Get(job.name()).state(), v1::Job::CANCELLED);
  ASSERT_EQ(back.conn->Assignments().size(), 1u);
  EXPECT_EQ(back.conn->Assignments()[0].job(), next.name());
  EXPECT_EQ(Get(next.name()).state(), v1::Job::RUNNING);
}

// A worker that came back while its job still runs on it (a short network drop) continues it.
TEST_F(ControllerTest, AReturningWorkerStillRunningItsJobContinues) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1), kAnon);
  controller_->DetachWorker(w1.session);
  now_ += absl::Seconds(3);
  auto back = Attach("w1", "127.0.0.1", /*send_held=*/false);
  v1::WorkerMessage held;
  held.mutable_held()->add_jobs(job.name());
  controller_->OnWorkerMessage(back.session, held);
  EXPECT_EQ(controller_->Workers()[0].state, "busy");
  EXPECT_EQ(back.conn->Count(v1::ControllerMessage::kCancel), 0);
  Result(back, job.name(), 0, true);
  EXPECT_EQ(Get(job.name()).state(), v1::Job::SUCCEEDED);
  EXPECT_EQ(controller_->Workers()[0].state, "idle");
}

}  // namespace
}  // namespace odyssey::server
