// The session router with N = 2 ranks (session_router.cc over rl_batch.h): Controller::Train
// over two recording worker connections: the split with offsets and W, the merged reply, the
// same call order on both ranks, save/export to rank 0 only, the specific error, the per-rank
// batch limit, a rank's detach, sequences and a cancel across the ranks.
#include "server/controller.h"

#include <functional>
#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "server/testing/controller_fixture.h"
#include "server/testing/datums.h"
#include "server/validation.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;
using ::testing::HasSubstr;
using testing::AsyncTrain;
using testing::CallConnection;
using testing::ControllerTest;
using testing::kAnon;
using testing::MakeDatum;

// ---------------------------------------------------------------------------------------------
// Multi-rank RL sessions: Controller::Train over two recording worker connections.

class TrainingRanksTest : public ControllerTest {
 protected:
  void SetUp() override {
    ControllerTest::SetUp();
    for (const char* id : {"w1", "w2"}) {
      v1::WorkerCapabilities caps;
      caps.set_worker_id(id);
      caps.set_device("cpu");
      conns_.push_back(std::make_shared<CallConnection>());
      sessions_.push_back(*odyssey::server::testing::AttachFresh(controller_.get(), caps, "127.0.0.1", conns_.back()));
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
  const std::string job_id = "job_id=\"" + job_.name().substr(5) + "\"";  // "jobs/N" -> N
  EXPECT_THAT(m, HasSubstr("odyssey_rl_logprob_mismatch_mean{" + job_id + "} 0.3125"));
  EXPECT_THAT(m, HasSubstr("odyssey_rl_logprob_mismatch_max{" + job_id + "} 0.9"));
  EXPECT_THAT(m, HasSubstr("odyssey_job_loss{" + job_id + "} 1.75"));  // the merged batch's, too
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
