// The gang scheduler (scheduler.h): ScheduleGangs on plain data, and through the Controller
// (whole gangs only, priority then FIFO).
#include "server/scheduler.h"

#include <map>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "absl/status/status.h"
#include "server/controller.h"
#include "server/testing/controller_fixture.h"
#include "server/validation.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;
using testing::ControllerTest;
using testing::kAnon;

// ---------------------------------------------------------------------------------------------
// ScheduleGangs on plain data: the rules of scheduler.h, one per test.

std::vector<int64_t> Started(const ScheduleDecision& d) {
  std::vector<int64_t> out;
  for (const GangStart& s : d.starts) out.push_back(s.job);
  return out;
}

// A 1-worker job behind a waiting 2-worker job does not jump it, and is not even judged.
TEST(ScheduleGangsTest, ASmallerJobNeverJumpsTheWaitingHead) {
  std::vector<int64_t> asked;
  auto admit = [&](int64_t id) {
    asked.push_back(id);
    return absl::OkStatus();
  };
  // Two workers attached, w2 busy: job 1 could run on this fleet, so it holds the head.
  const Fleet fleet{2, {{"w2", "jobs/7"}}};
  const ScheduleDecision d = ScheduleGangs({{1, 0, 2}, {2, 0, 1}}, {{"w1", "h1"}}, admit, &fleet);
  EXPECT_TRUE(d.starts.empty());
  EXPECT_TRUE(d.refused.empty());
  EXPECT_TRUE(asked.empty());
  ASSERT_EQ(d.waiting.size(), 2u);
  EXPECT_EQ(d.waiting[0].job, 1);
  EXPECT_EQ(d.waiting[0].reason, "needs 2 workers, 1 idle (busy: w2 with jobs/7)");
  EXPECT_FALSE(d.waiting[0].beyond_fleet);
  EXPECT_EQ(d.waiting[1].job, 2);
  EXPECT_EQ(d.waiting[1].reason,
            "queued behind jobs/1 (needs 2 workers, 1 idle); no backfill: server/README.md \"Scheduling\"");
  // The same holds across priorities: the head is the highest priority job.
  EXPECT_TRUE(ScheduleGangs({{1, 0, 1}, {2, 9, 2}}, {{"w1", "h1"}}, nullptr, &fleet).starts.empty());
}

// A job larger than the attached fleet is flagged and holds back nothing (a world_size of 4096,
// or 2 with one worker attached, used to block every later job, silently).
TEST(ScheduleGangsTest, AJobBeyondTheFleetIsFlaggedAndBlocksNothing) {
  const Fleet fleet{1, {}};
  const ScheduleDecision d = ScheduleGangs({{1, 0, 4096}, {2, 0, 2}, {3, 0, 1}}, {{"w1", "h1"}}, nullptr, &fleet);
  EXPECT_EQ(Started(d), (std::vector<int64_t>{3}));
  ASSERT_EQ(d.waiting.size(), 2u);
  EXPECT_TRUE(d.waiting[0].beyond_fleet);
  EXPECT_EQ(d.waiting[0].reason,
            "needs 4096 workers, 1 attached: more than the attached fleet; it starts once enough workers attach and "
            "holds back no other job");
  EXPECT_TRUE(d.waiting[1].beyond_fleet);
  EXPECT_EQ(d.waiting[1].job, 2);
}

// Never a partial gang: a 3-worker job with 2 idle workers waits.
TEST(ScheduleGangsTest, NoPartialStarts) {
  EXPECT_TRUE(ScheduleGangs({{1, 0, 3}}, {{"w1", "h1"}, {"w2", "h1"}}).starts.empty());
  const ScheduleDecision d = ScheduleGangs({{1, 0, 3}}, {{"w1", "h1"}, {"w2", "h1"}, {"w3", "h2"}});
  ASSERT_EQ(d.starts.size(), 1u);
  EXPECT_EQ(d.starts[0].workers, (std::vector<std::string>{"w1", "w2", "w3"}));
}

// Highest priority first, then the oldest (lowest id), whatever order the queue comes in.
TEST(ScheduleGangsTest, PriorityThenOldest) {
  const std::vector<QueuedJob> queue = {{3, 5, 1}, {1, 0, 1}, {2, 5, 1}, {4, 7, 1}};
  EXPECT_EQ(Started(ScheduleGangs(queue, {{"w1", "h1"}})), (std::vector<int64_t>{4}));
  EXPECT_EQ(Started(ScheduleGangs(queue, {{"w1", "h1"}, {"w2", "h1"}, {"w3", "h1"}})),
            (std::vector<int64_t>{4, 2, 3}));
  EXPECT_EQ(Started(ScheduleGangs(queue, {{"w1", "h1"}, {"w2", "h1"}, {"w3", "h1"}, {"w4", "h1"}, {"w5", "h1"}})),
            (std::vector<int64_t>{4, 2, 3, 1}));
}

// One host preferred over the first workers by id when hosts differ.
TEST(ScheduleGangsTest, PrefersWorkersOnOneHost) {
  const ScheduleDecision d = ScheduleGangs({{1, 0, 2}}, {{"w1", "h1"}, {"w2", "h2"}, {"w3", "h2"}});
  ASSERT_EQ(d.starts.size(), 1u);
  EXPECT_EQ(d.starts[0].workers, (std::vector<std::string>{"w2", "w3"}));
}

// Best fit: the host with the fewest idle workers that holds the gang, which keeps the larger
// host whole for the next, larger gang.
TEST(ScheduleGangsTest, BestFitKeepsLargerHostsWhole) {
  const ScheduleDecision d = ScheduleGangs(
      {{1, 0, 2}, {2, 0, 3}}, {{"w1", "h1"}, {"w2", "h1"}, {"w3", "h1"}, {"w4", "h2"}, {"w5", "h2"}});
  ASSERT_EQ(d.starts.size(), 2u);
  EXPECT_EQ(d.starts[0].job, 1);
  EXPECT_EQ(d.starts[0].workers, (std::vector<std::string>{"w4", "w5"}));
  EXPECT_EQ(d.starts[1].job, 2);
  EXPECT_EQ(d.starts[1].workers, (std::vector<std::string>{"w1", "w2", "w3"}));
}

// No host holds the gang: workers of every host, hosts in name order, ids in order per host;
// the ranks follow that order.
TEST(ScheduleGangsTest, SpreadsAcrossHostsWhenNoneHoldsTheGang) {
  const ScheduleDecision d =
      ScheduleGangs({{1, 0, 3}}, {{"w4", "h1"}, {"w1", "h2"}, {"w2", "h2"}, {"w3", "h1"}});
  ASSERT_EQ(d.starts.size(), 1u);
  EXPECT_EQ(d.starts[0].workers, (std::vector<std::string>{"w3", "w4", "w1"}));
}

// One pass starts every job that fits in order; each worker goes to one job only.
TEST(ScheduleGangsTest, StartsSeveralJobsWithoutSharingWorkers) {
  const ScheduleDecision d = ScheduleGangs({{1, 0, 1}, {2, 0, 1}, {3, 0, 1}}, {{"w2", "h1"}, {"w1", "h1"}});
  ASSERT_EQ(d.starts.size(), 2u);
  EXPECT_EQ(d.starts[0].job, 1);
  EXPECT_EQ(d.starts[0].workers, (std::vector<std::string>{"w1"}));
  EXPECT_EQ(d.starts[1].job, 2);
  EXPECT_EQ(d.starts[1].workers, (std::vector<std::string>{"w2"}));
}

// A refused job takes no workers: the next job gets them, and the refusal carries admit's message.
TEST(ScheduleGangsTest, ARefusedJobTakesNoWorkers) {
  auto admit = [](int64_t id) {
    return id == 1 ? absl::PermissionDeniedError("spec.model.name: outside") : absl::OkStatus();
  };
  const ScheduleDecision d = ScheduleGangs({{1, 0, 1}, {2, 0, 1}}, {{"w1", "h1"}}, admit);
  ASSERT_EQ(d.refused.size(), 1u);
  EXPECT_EQ(d.refused[0].job, 1);
  EXPECT_EQ(d.refused[0].why, "spec.model.name: outside");
  ASSERT_EQ(d.starts.size(), 1u);
  EXPECT_EQ(d.starts[0].job, 2);
  EXPECT_EQ(d.starts[0].workers, (std::vector<std::string>{"w1"}));
}

// ---------------------------------------------------------------------------------------------
// The scheduler through the Controller.

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

// Why a job waits is on the job (and shown by get/list/watch), and changes as the fleet does.
TEST_F(ControllerTest, PendingJobsSayWhyTheyWait) {
  auto w1 = Attach("w1");
  auto rl = Request(1);
  rl.mutable_spec()->set_kind(v1::RL_SESSION);
  rl.mutable_spec()->clear_steps();
  auto session = *controller_->CreateJob(rl, kAnon);
  auto big = *controller_->CreateJob(Request(2), kAnon);
  auto small = *controller_->CreateJob(Request(1), kAnon);
  EXPECT_EQ(Get(session.name()).state(), v1::Job::RUNNING);
  EXPECT_TRUE(Get(session.name()).pending_reason().empty());
  // Two workers needed, one attached: flagged, and it does not hold back the 1-worker job,
  // which waits for the busy worker instead, naming what holds it.
  EXPECT_TRUE(Get(big.name()).beyond_fleet());
  EXPECT_THAT(Get(big.name()).pending_reason(), ::testing::HasSubstr("needs 2 workers, 1 attached"));
  EXPECT_EQ(Get(small.name()).pending_reason(),
            "needs 1 worker, 0 idle (busy: w1 with " + session.name() +
                " (an RL session: it holds the worker until it ends or idles out))");
  // A second worker attaches: the 2-worker job is the head now, and the small one queues behind it.
  auto w2 = Attach("w2");
  EXPECT_FALSE(Get(big.name()).beyond_fleet());
  EXPECT_EQ(Get(big.name()).pending_reason(), "needs 2 workers, 1 idle (busy: w1 with " + session.name() +
                                                  " (an RL session: it holds the worker until it ends or idles out))");
  EXPECT_THAT(Get(small.name()).pending_reason(), ::testing::HasSubstr("queued behind " + big.name()));
  EXPECT_EQ(Get(small.name()).state(), v1::Job::PENDING);  // w2 is idle, but the head needs it
  // The session ends: the head starts, its reason is cleared.
  Result(w1, session.name(), 0, true);
  EXPECT_EQ(Get(big.name()).state(), v1::Job::RUNNING);
  EXPECT_TRUE(Get(big.name()).pending_reason().empty());
  EXPECT_THAT(Get(small.name()).pending_reason(), ::testing::HasSubstr("needs 1 worker, 0 idle"));
}

// Through the controller, with workers on two hosts: a 2-worker gang goes to the host that holds
// it whole (the smallest such host), and its rendezvous is on that host; a 1-worker job queued
// behind a waiting 3-worker head does not start on the idle worker left.
TEST_F(ControllerTest, GangsPreferOneHostAndNothingJumpsTheHead) {
  auto a1 = Attach("a1", "10.0.0.1");
  auto b1 = Attach("b1", "10.0.0.2"), b2 = Attach("b2", "10.0.0.2"), b3 = Attach("b3", "10.0.0.2");
  auto pair = *controller_->CreateJob(Request(2), kAnon);
  const v1::Job running = Get(pair.name());
  ASSERT_EQ(running.state(), v1::Job::RUNNING);
  EXPECT_EQ(std::vector<std::string>(running.workers().begin(), running.workers().end()),
            (std::vector<std::string>{"b1", "b2"}));
  ASSERT_EQ(b1.conn->Assignments().size(), 1u);
  EXPECT_EQ(b1.conn->Assignments()[0].rendezvous(), "10.0.0.2:" + std::to_string(29500 + 1));
  // a1 and b3 are idle; a 3-worker job waits at the head, and a 1-worker job behind it waits too.
  auto trio = *controller_->CreateJob(Request(3), kAnon);
  auto solo = *controller_->CreateJob(Request(1), kAnon);
  EXPECT_EQ(Get(trio.name()).state(), v1::Job::PENDING);
  EXPECT_EQ(Get(solo.name()).state(), v1::Job::PENDING);
  EXPECT_TRUE(a1.conn->Assignments().empty());
  EXPECT_TRUE(b3.conn->Assignments().empty());
  // Rank 0 of the pair ends: three idle workers (a1, b1, b3), no host holds three, so the trio
  // starts across hosts in host order; the solo job then takes b2 once it reports.
  Result(b1, pair.name(), 0, true);
  const v1::Job started = Get(trio.name());
  EXPECT_EQ(started.state(), v1::Job::RUNNING);
  EXPECT_EQ(std::vector<std::string>(started.workers().begin(), started.workers().end()),
            (std::vector<std::string>{"a1", "b1", "b3"}));
  EXPECT_EQ(Get(solo.name()).state(), v1::Job::PENDING);
  Result(b2, pair.name(), 1, true);
  EXPECT_EQ(Get(solo.name()).state(), v1::Job::RUNNING);
  EXPECT_EQ(Get(solo.name()).workers(0), "b2");
}

}  // namespace
}  // namespace odyssey::server
