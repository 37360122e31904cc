// The session router (session_router.cc): TrainingService calls of a one-rank RL session
// against a recording worker connection: arrival order, reply matching, sequences and gaps,
// detach/cancel failing pending calls, refusals, checkpoint and metrics updates.
#include "server/controller.h"

#include <functional>
#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "server/testing/controller_fixture.h"
#include "server/validation.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;
using ::testing::HasSubstr;
using testing::AsyncTrain;
using testing::CallConnection;
using testing::ControllerTest;
using testing::FakeConnection;
using testing::kAnon;

// ---------------------------------------------------------------------------------------------
// TrainingService routing (Controller::Train) against a recording worker connection.

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
    session_ = *odyssey::server::testing::AttachFresh(controller_.get(), caps, "127.0.0.1", conn_);
    v1::CreateJobRequest r = Request(1);
    r.mutable_spec()->set_kind(v1::RL_SESSION);
    r.mutable_spec()->clear_steps();
    r.mutable_spec()->mutable_data()->set_seq_len(8);
    r.mutable_spec()->mutable_data()->set_batch_size(2);  // 16 positions per call
    job_ = *controller_->CreateJob(r, kAnon);
    id_ = *ParseJobName(job_.name());
    ASSERT_EQ(Get(job_.name()).state(), v1::Job::RUNNING);
  }
  // odyssey_training_calls_waiting{job_id} of this session in the controller's registry; -1 when
  // the series does not exist.
  double WaitingGauge() const {
    for (const auto& family : registry_->Collect()) {
      if (family.name != "odyssey_training_calls_waiting") continue;
      for (const auto& metric : family.metric) {
        for (const auto& label : metric.label) {
          if (label.name == "job_id" && "jobs/" + label.value == job_.name()) return metric.gauge.value;
        }
      }
    }
    return -1;
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
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (controller_->WaitingCalls(id_) == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(controller_->WaitingCalls(id_), 1) << "call 2 never started waiting for its turn";
  EXPECT_EQ(WaitingGauge(), 1);  // what process tests wait on (odyssey_training_calls_waiting)
  EXPECT_EQ(controller_->RefuseInTurn(id_, 1, "OptimStep", bad), bad);
  auto calls = conn_->WaitForCalls(1);
  ASSERT_EQ(calls.size(), 1u);
  Reply(calls[0], [](v1::TrainingReply& r) { r.mutable_optim_step()->set_step(1); });
  EXPECT_EQ(two.Wait()->optim_step().step(), 1);
  EXPECT_EQ(WaitingGauge(), 0);
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
      r.mutable_forward_backward()->set_loss(2.5);
    });
    ASSERT_TRUE(fb.Wait().ok());
  }
  {
    AsyncTrain step(controller_.get(), id_, Step(1e-3), 0);
    auto calls = conn_->WaitForCalls(2);
    Reply(calls.back(), [](v1::TrainingReply& r) {
      r.mutable_optim_step()->set_step(7);
      r.mutable_optim_step()->set_grad_norm(0.75);
      r.mutable_optim_step()->set_lr(0.001);
    });
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
  // Rank 0's progress reports the same save: recorded once (one store row), not twice.
  v1::WorkerMessage progress;
  progress.mutable_progress()->set_job(job_.name());
  progress.mutable_progress()->mutable_metrics()->set_step(7);
  progress.mutable_progress()->set_checkpoint("/ckpt/step-00000007");
  controller_->OnWorkerMessage(session_, progress);
  {
    auto store = JobStore::Open((dir_ / "c.db").string());
    ASSERT_TRUE(store.ok()) << store.status();
    auto rows = (*store)->LoadCheckpoints(id_);
    ASSERT_TRUE(rows.ok());
    EXPECT_EQ(rows->size(), 1u);
  }
  controller_->CountTrainingCall("Forward", absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Get(job_.name()).last_checkpoint(), "/ckpt/step-00000007");
  const std::string m = Metrics();
  const std::string job = "job_id=\"" + job_.name().substr(5) + "\"";  // "jobs/N" -> N
  EXPECT_THAT(m, HasSubstr("odyssey_rl_logprob_mismatch_mean{" + job + "} 0.125"));
  EXPECT_THAT(m, HasSubstr("odyssey_rl_logprob_mismatch_max{" + job + "} 0.5"));
  EXPECT_THAT(m, HasSubstr("odyssey_rl_optimizer_step{" + job + "} 7"));
  EXPECT_THAT(m, HasSubstr("odyssey_job_loss{" + job + "} 2.5"));
  EXPECT_THAT(m, HasSubstr("odyssey_job_grad_norm{" + job + "} 0.75"));
  EXPECT_THAT(m, HasSubstr("odyssey_job_learning_rate{" + job + "} 0.001"));
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
  ASSERT_TRUE(odyssey::server::testing::AttachFresh(controller_.get(), caps, "127.0.0.1", conn).ok());
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

}  // namespace
}  // namespace odyssey::server
