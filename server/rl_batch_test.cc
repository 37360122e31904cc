// The RL batch split and merge (rl_batch.h) on plain protos: SplitBatch's cuts, SplitCall's
// per-rank calls and limits, MergeReplies' merge and error choice.
#include "server/rl_batch.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "absl/status/status.h"
#include "server/testing/datums.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;
using ::testing::HasSubstr;
using testing::Batch;
using testing::MakeDatum;

// Contiguous ranges cut nearest to the token quantiles; empty ranges when datums run out.
TEST(SplitBatchTest, BalancesTokensInDatumOrder) {
  using Ranges = std::vector<std::pair<int, int>>;
  EXPECT_EQ(SplitBatch(Batch({4, 4, 4, 4, 4}), 2), (Ranges{{0, 3}, {3, 5}}));  // 12 | 8 (a tie: the later cut)
  EXPECT_EQ(SplitBatch(Batch({4, 4, 4, 4, 5}), 2), (Ranges{{0, 3}, {3, 5}}));  // 12 | 9: 10.5 is nearer 12 than 8
  EXPECT_EQ(SplitBatch(Batch({2, 2, 2, 2, 9}), 2), (Ranges{{0, 4}, {4, 5}}));
  EXPECT_EQ(SplitBatch(Batch({10, 1, 1, 1, 1}), 2), (Ranges{{0, 1}, {1, 5}}));
  EXPECT_EQ(SplitBatch(Batch({1, 1, 1, 1}), 3), (Ranges{{0, 1}, {1, 3}, {3, 4}}));
  EXPECT_EQ(SplitBatch(Batch({5}), 2), (Ranges{{0, 1}, {1, 1}}));
  EXPECT_EQ(SplitBatch(Batch({}), 2), (Ranges{{0, 0}, {0, 0}}));
  EXPECT_EQ(SplitBatch(Batch({3, 3}), 1), (Ranges{{0, 2}}));
}

// A session of 2 ranks whose ranks each hold 8 x 2 = 16 positions.
v1::JobSpec Spec() {
  v1::JobSpec s;
  s.mutable_data()->set_seq_len(8);
  s.mutable_data()->set_batch_size(2);
  return s;
}

v1::TrainingCall Fb(const std::vector<v1::Datum>& batch) {
  v1::TrainingCall c;
  for (const v1::Datum& d : batch) *c.mutable_forward_backward()->add_batch() = d;
  c.mutable_forward_backward()->mutable_loss()->set_kind("ppo");
  return c;
}

TEST(RankPositionLimitTest, SeqLenTimesBatchSize) {
  EXPECT_EQ(RankPositionLimit(Spec()), 16);
  v1::JobSpec s = Spec();
  s.mutable_data()->clear_batch_size();  // 0 counts 1
  EXPECT_EQ(RankPositionLimit(s), 8);
}

TEST(BatchPositionsTest, CountsTheBatchOfForwardAndForwardBackward) {
  EXPECT_EQ(BatchPositions(Fb({MakeDatum(3), MakeDatum(4)})), 7);
  v1::TrainingCall f;
  *f.mutable_forward()->add_batch() = MakeDatum(5);
  EXPECT_EQ(BatchPositions(f), 5);
  v1::TrainingCall step;
  step.mutable_optim_step();
  EXPECT_EQ(BatchPositions(step), 0);
}

// forward_backward: every rank its token-balanced slice, its whole-batch offset and W of the
// whole batch (weights summed, 1 per token without weights); the rest of the call unchanged.
TEST(SplitCallTest, ForwardBackwardSlicesWithOffsetsAndW) {
  auto calls = SplitCall(Fb({MakeDatum(6, 0.5f), MakeDatum(2), MakeDatum(2), MakeDatum(2)}), 2, Spec());
  ASSERT_TRUE(calls.ok()) << calls.status();
  ASSERT_EQ(calls->size(), 2u);
  const v1::TrainingCall& r0 = (*calls)[0].call;
  const v1::TrainingCall& r1 = (*calls)[1].call;
  EXPECT_EQ((*calls)[0].rank, 0);
  EXPECT_EQ((*calls)[1].rank, 1);
  ASSERT_EQ(r0.forward_backward().batch_size(), 1);
  ASSERT_EQ(r1.forward_backward().batch_size(), 3);
  EXPECT_EQ(r0.forward_backward().batch(0).tokens_size(), 6);
  EXPECT_EQ(r0.datum_offset(), 0);
  EXPECT_EQ(r1.datum_offset(), 1);
  EXPECT_DOUBLE_EQ(r0.weight_sum(), 9);  // 6 x 0.5 + 6 x 1
  EXPECT_DOUBLE_EQ(r1.weight_sum(), 9);
  EXPECT_EQ(r1.forward_backward().loss().kind(), "ppo");
  EXPECT_EQ(r0.call_id(), 0);  // the router's to set
  EXPECT_EQ(r0.job(), "");
}

// A W that is not a positive finite number is not sent (0): the engine sums the slices' own
// weights and its validation names the bad one.
TEST(SplitCallTest, NonFiniteOrZeroWIsNotSent) {
  v1::Datum nan = MakeDatum(2, 1.0f);
  nan.set_weights(1, std::nanf(""));
  auto calls = SplitCall(Fb({nan, MakeDatum(2)}), 2, Spec());
  ASSERT_TRUE(calls.ok()) << calls.status();
  EXPECT_EQ((*calls)[0].call.weight_sum(), 0);
  EXPECT_EQ((*calls)[1].call.weight_sum(), 0);
  v1::Datum zero = MakeDatum(2);
  zero.add_weights(0);
  zero.add_weights(0);
  calls = SplitCall(Fb({zero, zero}), 2, Spec());
  ASSERT_TRUE(calls.ok()) << calls.status();
  EXPECT_EQ((*calls)[1].call.weight_sum(), 0);
}

// forward: slices and offsets, an empty slice for a rank past the last datum, no W.
TEST(SplitCallTest, ForwardGivesEveryRankACallEmptyOrNot) {
  v1::TrainingCall f;
  *f.mutable_forward()->add_batch() = MakeDatum(5);
  auto calls = SplitCall(f, 2, Spec());
  ASSERT_TRUE(calls.ok()) << calls.status();
  ASSERT_EQ(calls->size(), 2u);
  EXPECT_EQ((*calls)[0].call.forward().batch_size(), 1);
  EXPECT_EQ((*calls)[0].call.datum_offset(), 0);
  ASSERT_TRUE((*calls)[1].call.has_forward());
  EXPECT_EQ((*calls)[1].call.forward().batch_size(), 0);
  EXPECT_EQ((*calls)[1].call.datum_offset(), 1);
  EXPECT_EQ((*calls)[0].call.weight_sum(), 0);  // forward has no loss
}

// optim_step and load_checkpoint to every rank; save_checkpoint and export_weights to rank 0.
TEST(SplitCallTest, WhichRanksACallReaches) {
  v1::TrainingCall step;
  step.mutable_optim_step()->mutable_adam()->set_lr(0.5);
  v1::TrainingCall load;
  load.mutable_load_checkpoint()->set_directory("/ckpt/a");
  v1::TrainingCall save;
  save.mutable_save_checkpoint()->set_directory("/ckpt/b");
  v1::TrainingCall exp;
  exp.mutable_export_weights()->set_directory("/export/c");
  for (const v1::TrainingCall& every : {step, load}) {
    auto calls = SplitCall(every, 3, Spec());
    ASSERT_TRUE(calls.ok()) << calls.status();
    ASSERT_EQ(calls->size(), 3u);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ((*calls)[static_cast<size_t>(r)].rank, r);
      EXPECT_EQ((*calls)[static_cast<size_t>(r)].call.SerializeAsString(), every.SerializeAsString());
    }
  }
  for (const v1::TrainingCall& rank0 : {save, exp}) {
    auto calls = SplitCall(rank0, 3, Spec());
    ASSERT_TRUE(calls.ok()) << calls.status();
    ASSERT_EQ(calls->size(), 1u);
    EXPECT_EQ((*calls)[0].rank, 0);
    EXPECT_EQ((*calls)[0].call.SerializeAsString(), rank0.SerializeAsString());
  }
}

// The limit is per rank: the whole batch may hold world x 16 positions, no slice more than 16.
TEST(SplitCallTest, BatchLimitIsPerRank) {
  auto calls = SplitCall(Fb({MakeDatum(16), MakeDatum(16), MakeDatum(1)}), 2, Spec());
  EXPECT_EQ(calls.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(calls.status().message()),
              HasSubstr("batch: 33 token positions exceed the session's limit of 32 (2 ranks x 16: "
                        "spec.data.seq_len 8 x spec.data.batch_size 2"));
  calls = SplitCall(Fb({MakeDatum(2), MakeDatum(20)}), 2, Spec());
  EXPECT_EQ(calls.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(calls.status().message()),
              HasSubstr("batch: rank 1's slice (batch[1..1]) holds 20 token positions, over the per-rank limit of 16"));
  EXPECT_TRUE(SplitCall(Fb({MakeDatum(16), MakeDatum(16)}), 2, Spec()).ok());
}

// A context-parallel session: every rank gets the whole batch of forward_backward (with the
// whole W, offset 0) and forward; the limit bounds the whole batch; other calls as without.
TEST(SplitCallTest, ContextParallelSendsTheWholeBatchToEveryRank) {
  v1::JobSpec spec = Spec();
  spec.mutable_parallel()->set_world_size(2);
  spec.mutable_parallel()->set_context_parallel(2);
  EXPECT_EQ(ContextParallelDegree(spec), 2);
  EXPECT_EQ(ContextParallelDegree(Spec()), 1);
  const v1::TrainingCall fb = Fb({MakeDatum(5, 2.0f), MakeDatum(3)});
  auto calls = SplitCall(fb, 2, spec);
  ASSERT_TRUE(calls.ok()) << calls.status();
  ASSERT_EQ(calls->size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const v1::TrainingCall& c = (*calls)[static_cast<size_t>(r)].call;
    EXPECT_EQ((*calls)[static_cast<size_t>(r)].rank, r);
    ASSERT_EQ(c.forward_backward().batch_size(), 2);
    EXPECT_EQ(c.forward_backward().batch(1).tokens_size(), 3);
    EXPECT_EQ(c.datum_offset(), 0);
    EXPECT_DOUBLE_EQ(c.weight_sum(), 5 * 2.0 + 3);  // absent weights count 1
  }
  v1::TrainingCall f;
  *f.mutable_forward()->add_batch() = MakeDatum(5);
  calls = SplitCall(f, 2, spec);
  ASSERT_TRUE(calls.ok()) << calls.status();
  ASSERT_EQ(calls->size(), 2u);
  EXPECT_EQ((*calls)[1].call.forward().batch_size(), 1);
  EXPECT_EQ((*calls)[1].call.weight_sum(), 0);
  // seq_len 8 x batch_size 2 bounds the whole batch, not each rank's part.
  calls = SplitCall(Fb({MakeDatum(16), MakeDatum(1)}), 2, spec);
  EXPECT_EQ(calls.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(calls.status().message()),
              HasSubstr("batch: 17 token positions exceed the session's limit of 16 (spec.data.seq_len 8 x "
                        "spec.data.batch_size 2, the memory the planner checked, spread over "
                        "parallel.context_parallel 2 ranks)"));
  v1::TrainingCall save;
  save.mutable_save_checkpoint()->set_directory("/ckpt/b");
  calls = SplitCall(save, 2, spec);
  ASSERT_TRUE(calls.ok()) << calls.status();
  EXPECT_EQ(calls->size(), 1u);
}

// Data parallel over context-parallel groups (world 4, P 2): each group's two ranks get the
// group's slice (its offset, the whole W); the limits are per group.
TEST(SplitCallTest, ContextParallelGroupsShareTheirSlice) {
  v1::JobSpec spec = Spec();
  spec.mutable_parallel()->set_world_size(4);
  spec.mutable_parallel()->set_context_parallel(2);
  const v1::TrainingCall fb = Fb({MakeDatum(6), MakeDatum(7), MakeDatum(5)});
  auto calls = SplitCall(fb, 4, spec);
  ASSERT_TRUE(calls.ok()) << calls.status();
  ASSERT_EQ(calls->size(), 4u);
  for (int r = 0; r < 4; ++r) {
    const v1::TrainingCall& c = (*calls)[static_cast<size_t>(r)].call;
    EXPECT_EQ((*calls)[static_cast<size_t>(r)].rank, r);
    EXPECT_DOUBLE_EQ(c.weight_sum(), 18) << r;
    EXPECT_EQ(c.forward_backward().batch_size(), r < 2 ? 1 : 2) << r;  // cut nearest 9 of 18 tokens
    EXPECT_EQ(c.datum_offset(), r < 2 ? 0 : 1) << r;
  }
  EXPECT_EQ((*calls)[2].call.SerializeAsString(), (*calls)[3].call.SerializeAsString());
  calls = SplitCall(Fb({MakeDatum(2), MakeDatum(20)}), 4, spec);
  EXPECT_EQ(calls.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(calls.status().message()),
              HasSubstr("batch: context-parallel group 1 (ranks 2..3)'s slice (batch[1..1]) holds 20 token positions, "
                        "over the per-group limit of 16"));
  calls = SplitCall(Fb({MakeDatum(16), MakeDatum(16), MakeDatum(1)}), 4, spec);
  EXPECT_THAT(std::string(calls.status().message()),
              HasSubstr("batch: 33 token positions exceed the session's limit of 32 (2 context-parallel groups x 16"));
}

v1::TrainingReply FbReply(int logprob_datums, double loss, double mismatch_mean, double mismatch_max,
                          int64_t mismatch_tokens, int64_t clipped, int64_t tokens, double seconds) {
  v1::TrainingReply r;
  r.set_call_id(7);
  r.set_job("jobs/1");
  auto* fb = r.mutable_forward_backward();
  for (int d = 0; d < logprob_datums; ++d) fb->add_logprobs()->add_values(-1.0f * static_cast<float>(d + 1) * loss);
  fb->set_loss(loss);
  fb->set_weight_sum(9);
  fb->set_mismatch_mean(mismatch_mean);
  fb->set_mismatch_max(mismatch_max);
  fb->set_mismatch_tokens(mismatch_tokens);
  fb->set_clipped_tokens(clipped);
  fb->set_tokens(tokens);
  fb->set_seconds(seconds);
  return r;
}

// forward_backward: logprobs in rank (= datum) order, losses summed, W kept, mismatch
// token-weighted and its max, counts summed, the slowest rank's seconds.
TEST(MergeRepliesTest, ForwardBackward) {
  std::vector<v1::TrainingReply> replies = {FbReply(1, 1.25, 0.125, 0.2, 2, 2, 6, 3.0),
                                            FbReply(3, 0.5, 0.375, 0.9, 6, 1, 6, 2.0)};
  // Phase times (spec.profile.phase_times) come from rank 0, which times the call.
  v1::PhaseSeconds* ph = replies[0].mutable_forward_backward()->add_phases();
  ph->set_phase("backward");
  ph->set_seconds(2.5);
  auto merged = MergeReplies(v1::TrainingCall::kForwardBackward, /*context_parallel=*/1, replies);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ASSERT_EQ(merged->forward_backward().phases_size(), 1);
  EXPECT_EQ(merged->forward_backward().phases(0).phase(), "backward");
  EXPECT_DOUBLE_EQ(merged->forward_backward().phases(0).seconds(), 2.5);
  EXPECT_EQ(merged->call_id(), 7);
  EXPECT_EQ(merged->job(), "jobs/1");
  const v1::ForwardBackwardResponse& fb = merged->forward_backward();
  ASSERT_EQ(fb.logprobs_size(), 4);
  EXPECT_FLOAT_EQ(fb.logprobs(0).values(0), -1.25f);
  EXPECT_FLOAT_EQ(fb.logprobs(1).values(0), -0.5f);
  EXPECT_FLOAT_EQ(fb.logprobs(3).values(0), -1.5f);
  EXPECT_DOUBLE_EQ(fb.loss(), 1.75);
  EXPECT_DOUBLE_EQ(fb.weight_sum(), 9);
  EXPECT_EQ(fb.mismatch_tokens(), 8);
  EXPECT_DOUBLE_EQ(fb.mismatch_mean(), (0.125 * 2 + 0.375 * 6) / 8);
  EXPECT_DOUBLE_EQ(fb.mismatch_max(), 0.9);
  EXPECT_EQ(fb.clipped_tokens(), 3);
  EXPECT_EQ(fb.tokens(), 12);
  EXPECT_DOUBLE_EQ(fb.seconds(), 3.0);
  // No mismatch tokens anywhere: the mean stays 0 (no division by zero).
  merged = MergeReplies(v1::TrainingCall::kForwardBackward, /*context_parallel=*/1,
                        {FbReply(1, 1, 0, 0, 0, 0, 4, 1), FbReply(1, 1, 0, 0, 0, 0, 4, 1)});
  ASSERT_TRUE(merged.ok());
  EXPECT_EQ(merged->forward_backward().mismatch_mean(), 0);
}

TEST(MergeRepliesTest, ForwardConcatenatesLogprobsInRankOrder) {
  std::vector<v1::TrainingReply> replies(3);
  replies[0].mutable_forward()->add_logprobs()->add_values(-1);
  replies[1].mutable_forward();  // an empty slice
  replies[2].mutable_forward()->add_logprobs()->add_values(-3);
  replies[2].mutable_forward()->add_logprobs()->add_values(-4);
  auto merged = MergeReplies(v1::TrainingCall::kForward, /*context_parallel=*/1, replies);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ASSERT_EQ(merged->forward().logprobs_size(), 3);
  EXPECT_FLOAT_EQ(merged->forward().logprobs(0).values(0), -1);
  EXPECT_FLOAT_EQ(merged->forward().logprobs(1).values(0), -3);
  EXPECT_FLOAT_EQ(merged->forward().logprobs(2).values(0), -4);
}

// Calls that are not split: rank 0's reply.
TEST(MergeRepliesTest, OtherCallsAreRankZerosReply) {
  std::vector<v1::TrainingReply> replies(2);
  replies[0].mutable_optim_step()->set_step(3);
  replies[0].mutable_optim_step()->set_grad_norm(0.5);
  replies[1].mutable_optim_step()->set_step(3);
  replies[1].mutable_optim_step()->set_grad_norm(0.7);
  auto merged = MergeReplies(v1::TrainingCall::kOptimStep, /*context_parallel=*/1, replies);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_DOUBLE_EQ(merged->optim_step().grad_norm(), 0.5);
}

// A context-parallel session's ranks each answer for the whole batch: rank 0's reply, nothing
// summed or concatenated.
TEST(MergeRepliesTest, ContextParallelIsRankZerosReply) {
  auto merged = MergeReplies(v1::TrainingCall::kForwardBackward, /*context_parallel=*/2,
                             {FbReply(2, 1.25, 0.125, 0.2, 2, 2, 6, 3.0), FbReply(2, 1.25, 0.125, 0.2, 2, 2, 6, 2.0)});
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->forward_backward().logprobs_size(), 2);
  EXPECT_DOUBLE_EQ(merged->forward_backward().loss(), 1.25);
  EXPECT_EQ(merged->forward_backward().tokens(), 6);
  std::vector<v1::TrainingReply> replies(2);
  for (auto& r : replies) r.mutable_forward()->add_logprobs()->add_values(-2);
  merged = MergeReplies(v1::TrainingCall::kForward, /*context_parallel=*/2, replies);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->forward().logprobs_size(), 1);
}

// Two context-parallel groups of two: each group's first reply, merged as two data-parallel
// ranks' (losses summed, logprobs concatenated in group order).
TEST(MergeRepliesTest, ContextParallelGroupsMergeTheirFirstReplies) {
  auto merged = MergeReplies(v1::TrainingCall::kForwardBackward, /*context_parallel=*/2,
                             {FbReply(1, 1.25, 0.125, 0.2, 2, 2, 6, 3.0), FbReply(1, 1.25, 0.125, 0.2, 2, 2, 6, 3.0),
                              FbReply(3, 0.5, 0.375, 0.9, 6, 1, 6, 2.0), FbReply(3, 0.5, 0.375, 0.9, 6, 1, 6, 2.0)});
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->forward_backward().logprobs_size(), 4);
  EXPECT_DOUBLE_EQ(merged->forward_backward().loss(), 1.75);
  EXPECT_EQ(merged->forward_backward().tokens(), 12);
  EXPECT_EQ(merged->forward_backward().clipped_tokens(), 3);
}

v1::TrainingReply Error(absl::StatusCode code, const std::string& message) {
  v1::TrainingReply r;
  r.set_code(static_cast<int>(code));
  r.set_message(message);
  return r;
}

// The failing rank's own error, not another rank's echo of it, wherever it is; with only echoes
// the first in rank order; one OK rank does not hide another's error.
TEST(MergeRepliesTest, TheSpecificErrorWins) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  auto merged = MergeReplies(v1::TrainingCall::kForwardBackward, /*context_parallel=*/1,
                             {Error(kInvalid, "batch: refused on another rank (its slice of the batch is invalid)"),
                              Error(kInvalid, "batch[3].target_tokens[1] (999) must be in [0, 256)")});
  EXPECT_EQ(merged.status(), absl::InvalidArgumentError("batch[3].target_tokens[1] (999) must be in [0, 256)"));
  merged = MergeReplies(v1::TrainingCall::kOptimStep, /*context_parallel=*/1,
                        {Error(absl::StatusCode::kInternal, "optim_step failed on another rank; first"),
                         Error(absl::StatusCode::kInternal, "optim_step failed on another rank; second")});
  EXPECT_EQ(merged.status(), absl::InternalError("optim_step failed on another rank; first"));
  std::vector<v1::TrainingReply> replies = {v1::TrainingReply(), Error(absl::StatusCode::kFailedPrecondition, "no gradients"),
                                            Error(kInvalid, "later")};
  replies[0].mutable_optim_step()->set_step(1);
  merged = MergeReplies(v1::TrainingCall::kOptimStep, /*context_parallel=*/1, replies);
  EXPECT_EQ(merged.status(), absl::FailedPreconditionError("no gradients"));
}

}  // namespace
}  // namespace odyssey::server
