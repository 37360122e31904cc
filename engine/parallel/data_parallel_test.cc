// Data-parallel training: GradientReducer's sums, and through the Trainer: ranks stay
// identical, and their step equals one rank's step on the concatenated batch.
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/parallel/communicator.h"
#include "engine/parallel/data_parallel.h"
#include "engine/parallel/parallel_testing.h"
#include "engine/trainer.h"

namespace odyssey::engine {
namespace {

using parallel_testing::CopyWeights;

// Parameters a (a gradient on every rank), b (only on rank 1) and c (on none), and a rider.
TEST(GradientReducerTest, SumsGradientsAndKeepsAbsentOnesAbsent) {
  auto group = InProcessGroup::Create(2, absl::Seconds(60));
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < 2; ++r) comms.push_back(group->Rank(r));
  std::vector<std::vector<torch::Tensor>> grads(2);
  std::vector<torch::Tensor> riders(2);
  std::vector<absl::StatusOr<TokenShare>> shares(2, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const auto leaf = torch::requires_grad();
      std::vector<torch::Tensor> params = {torch::zeros({3}, leaf), torch::zeros({2, 2}, leaf), torch::zeros({5}, leaf)};
      params[0].mutable_grad() = torch::full({3}, static_cast<float>(r + 1));
      if (r == 1) params[1].mutable_grad() = torch::full({2, 2}, 0.5f);
      GradientReducer reducer(*comms[static_cast<size_t>(r)], params);
      shares[static_cast<size_t>(r)] = reducer.ShareTokens(/*local_targets=*/r == 0 ? 30 : 10, /*local_positions=*/64);
      std::vector<torch::Tensor> rider = {torch::full({1}, 0.25f * static_cast<float>(r + 1))};
      ASSERT_TRUE(reducer.Reduce(rider).ok());
      for (const torch::Tensor& p : params) grads[static_cast<size_t>(r)].push_back(p.grad());
      riders[static_cast<size_t>(r)] = rider[0];
    });
  }
  for (auto& t : threads) t.join();
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(grads[r].size(), 3u);
    EXPECT_TRUE(torch::equal(grads[r][0], torch::full({3}, 3.0f))) << "rank " << r;
    EXPECT_TRUE(torch::equal(grads[r][1], torch::full({2, 2}, 0.5f))) << "rank " << r;
    EXPECT_FALSE(grads[r][2].defined()) << "rank " << r << ": no rank had a gradient for c";
    EXPECT_TRUE(torch::equal(riders[r], torch::full({1}, 0.75f))) << "rank " << r;
    ASSERT_TRUE(shares[r].ok()) << shares[r].status();
    EXPECT_EQ(shares[r]->targets, 40);
    EXPECT_EQ(shares[r]->positions, 128);
  }
  EXPECT_EQ(shares[0]->loss_scale, 30.0 / 40.0);
  EXPECT_EQ(shares[1]->loss_scale, 10.0 / 40.0);
}

// One rank: Reduce leaves every gradient as it was (bitwise, absent ones absent) and the share
// of the mean loss is exactly 1.
TEST(GradientReducerTest, OneRankIsTheIdentity) {
  SingleRankCommunicator alone;
  std::vector<torch::Tensor> params = {torch::zeros({4}, torch::requires_grad()), torch::zeros({2}, torch::requires_grad())};
  const torch::Tensor g = torch::randn({4}).to(torch::kBFloat16).to(torch::kFloat32);
  params[0].mutable_grad() = g.clone();
  GradientReducer reducer(alone, params);
  absl::StatusOr<TokenShare> share = reducer.ShareTokens(/*local_targets=*/0, /*local_positions=*/8);
  ASSERT_TRUE(share.ok()) << share.status();
  EXPECT_EQ(share->loss_scale, 1.0);
  EXPECT_EQ(share->targets, 0);
  EXPECT_EQ(share->positions, 8);
  std::vector<torch::Tensor> riders = {torch::full({1}, 1.5f)};
  ASSERT_TRUE(reducer.Reduce(riders).ok());
  EXPECT_TRUE(torch::equal(params[0].grad(), g));
  EXPECT_FALSE(params[1].grad().defined());
  EXPECT_EQ(riders[0].item<float>(), 1.5f);
}

TrainerOptions Tiny() {
  TrainerOptions o;
  o.model = "tiny";
  o.device = "cpu";
  o.dtype = "float32";
  o.steps = 10;
  o.optimizer.lr = 1e-3;
  o.optimizer.weight_decay = 0.1;
  o.schedule.warmup_steps = 2;
  o.grad_clip = 0.5;  // low enough to clip: clipping must see the reduced gradients
  o.data.format = "kjv";
  o.data.seq_len = 32;
  o.data.batch_size = 2;
  o.seed = 3;
  return o;
}

void ExpectClose(Trainer& a, Trainer& b, double rtol, double atol, const std::string& what) {
  auto pa = a.model()->named_parameters();
  auto pb = b.model()->named_parameters();
  for (auto& p : pa) {
    const torch::Tensor& x = p.value();
    const torch::Tensor& y = pb[p.key()];
    const double err = (x - y).abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(x, y, rtol, atol)) << what << ": " << p.key() << " max |diff| " << err;
  }
}

// Two ranks of `o` over an in-process group, created concurrently (their weights broadcast from
// rank 0). Null where creation failed; `created` holds each rank's status.
struct TwoRanks {
  std::shared_ptr<InProcessGroup> group;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<Trainer>> ranks{2};
  std::vector<absl::Status> created{2};
};
std::unique_ptr<TwoRanks> MakeTwoRanks(const TrainerOptions& o) {
  auto two = std::make_unique<TwoRanks>();
  two->group = InProcessGroup::Create(2, absl::Seconds(60));
  for (int r = 0; r < 2; ++r) two->comms.push_back(two->group->Rank(r));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&two, &o, r] {
      TrainerOptions ro = o;
      ro.communicator = two->comms[r].get();
      auto t = Trainer::Create(ro);
      two->created[r] = t.status();
      if (t.ok()) two->ranks[r] = *std::move(t);
    });
  }
  for (auto& t : threads) t.join();
  return two;
}

// The batch of rank 0's rows then rank 1's: what one rank trains on.
Batch Concatenated(const Batch& a, const Batch& b) {
  Batch both;
  both.input_ids = torch::cat({a.input_ids, b.input_ids});
  both.labels = torch::cat({a.labels, b.labels});
  both.loss_mask = torch::cat({a.loss_mask, b.loss_mask});
  both.position_ids = torch::cat({a.position_ids, b.position_ids});
  return both;
}

// One step of both ranks together (rank 1 on its own thread).
std::pair<StepResult, StepResult> StepBoth(TwoRanks& two, const Batch& a, const Batch& b) {
  StepResult r0, r1;
  std::thread t1([&] { r1 = two.ranks[1]->Step(b); });
  r0 = two.ranks[0]->Step(a);
  t1.join();
  return {r0, r1};
}

TEST(DataParallelTest, TwoRanksStayIdenticalAndEqualOneRankOnTheConcatenatedBatch) {
  torch::set_num_threads(1);
  auto single = Trainer::Create(Tiny());
  ASSERT_TRUE(single.ok()) << single.status();
  std::unique_ptr<TwoRanks> two = MakeTwoRanks(Tiny());
  ASSERT_TRUE(two->created[0].ok()) << two->created[0];
  ASSERT_TRUE(two->created[1].ok()) << two->created[1];
  std::vector<std::unique_ptr<Trainer>>& ranks = two->ranks;
  ExpectClose(*ranks[0], *ranks[1], 0, 0, "initial weights (broadcast from rank 0)");
  CopyWeights(*ranks[0], **single);

  // Each rank samples its own batches (data seed + rank).
  EXPECT_FALSE(torch::equal(ranks[0]->data().Next().input_ids, ranks[1]->data().Next().input_ids));

  for (int step = 0; step < 4; ++step) {
    Batch a = (*single)->data().Next(), b = (*single)->data().Next();
    auto [r0, r1] = StepBoth(*two, a, b);
    ASSERT_TRUE(r0.status.ok()) << r0.status;
    ASSERT_TRUE(r1.status.ok()) << r1.status;
    StepResult rs = (*single)->Step(Concatenated(a, b));

    EXPECT_EQ(r0.loss, r1.loss);
    EXPECT_EQ(r0.grad_norm, r1.grad_norm);
    EXPECT_NEAR(r0.loss, rs.loss, 1e-6 * rs.loss);
    EXPECT_NEAR(r0.grad_norm, rs.grad_norm, 1e-5 * rs.grad_norm);
    EXPECT_EQ(r0.tokens, rs.tokens);
    EXPECT_EQ(r0.target_tokens, rs.target_tokens);
    EXPECT_EQ(r0.step, step + 1);
    ExpectClose(*ranks[0], *ranks[1], 0, 0, "rank 0 vs rank 1");     // bitwise identical
    // The two sides sum the same per-token gradients in different orders, and AdamW divides
    // by sqrt(v): entries with near-zero gradients turn rounding into update differences of
    // ~1e-6. A wrong reduction (a missing or doubled average) moves weights by ~lr = 1e-3.
    ExpectClose(*ranks[0], **single, 1e-5, 1e-5, "data parallel vs one rank");
  }
}

// With the optimizer on the host, replicas send each layer group's gradients to it from the
// backward, after their all-reduce there, as one rank sends its own: they train as one rank on
// the concatenated batch. deferred_cpu updates from the gradients as they were when sent, so a
// group sent before its all-reduce (this rank's half of the batch) or reduced twice moves the
// weights by ~lr; both ranks send as many parameters early as one rank does.
TEST(DataParallelTest, HostOptimizerReplicasSendReducedLayerGradientsFromTheBackward) {
  torch::set_num_threads(1);
  TrainerOptions o = Tiny();
  o.memory.recompute = planner::Recompute::kLayer;
  o.memory.optimizer_on_host = true;
  o.host_optimizer.deferred_cpu = true;
  auto single = Trainer::Create(o);
  ASSERT_TRUE(single.ok()) << single.status();
  std::unique_ptr<TwoRanks> two = MakeTwoRanks(o);
  ASSERT_TRUE(two->created[0].ok()) << two->created[0];
  ASSERT_TRUE(two->created[1].ok()) << two->created[1];
  std::vector<std::unique_ptr<Trainer>>& ranks = two->ranks;
  CopyWeights(*ranks[0], **single);
  for (int step = 0; step < 3; ++step) {
    Batch a = (*single)->data().Next(), b = (*single)->data().Next();
    auto [r0, r1] = StepBoth(*two, a, b);
    ASSERT_TRUE(r0.status.ok()) << r0.status;
    ASSERT_TRUE(r1.status.ok()) << r1.status;
    StepResult rs = (*single)->Step(Concatenated(a, b));
    ASSERT_TRUE(rs.status.ok()) << rs.status;
    EXPECT_GT((*single)->params_sent_in_backward(), 0);
    EXPECT_EQ(ranks[0]->params_sent_in_backward(), (*single)->params_sent_in_backward());
    EXPECT_EQ(ranks[1]->params_sent_in_backward(), (*single)->params_sent_in_backward());
    EXPECT_EQ(r0.loss, r1.loss);
    EXPECT_EQ(r0.grad_norm, r1.grad_norm);
    EXPECT_NEAR(r0.loss, rs.loss, 1e-6 * rs.loss);
    EXPECT_NEAR(r0.grad_norm, rs.grad_norm, 1e-5 * rs.grad_norm);
    ExpectClose(*ranks[0], *ranks[1], 0, 0, "rank 0 vs rank 1");
    ExpectClose(*ranks[0], **single, 1e-5, 1e-5, "data parallel vs one rank");
  }
}

// Ranks with different numbers of target tokens: the loss is still the mean over all targets
// (not the mean of the ranks' means).
TEST(DataParallelTest, UnequalTargetCountsWeighTokensNotRanks) {
  torch::set_num_threads(1);
  auto single = Trainer::Create(Tiny());
  ASSERT_TRUE(single.ok()) << single.status();
  std::unique_ptr<TwoRanks> two = MakeTwoRanks(Tiny());
  ASSERT_TRUE(two->ranks[0] && two->ranks[1]);
  std::vector<std::unique_ptr<Trainer>>& ranks = two->ranks;
  CopyWeights(*ranks[0], **single);

  Batch a = (*single)->data().Next(), b = (*single)->data().Next();
  b.loss_mask.slice(1, 0, 20).zero_();  // rank 1 counts 12 of 32 positions per row
  const StepResult r0 = StepBoth(*two, a, b).first;
  StepResult rs = (*single)->Step(Concatenated(a, b));
  EXPECT_EQ(r0.target_tokens, rs.target_tokens);
  EXPECT_NEAR(r0.loss, rs.loss, 1e-6 * rs.loss);
  ExpectClose(*ranks[0], *ranks[1], 0, 0, "rank 0 vs rank 1");
  ExpectClose(*ranks[0], **single, 1e-5, 1e-5, "data parallel vs one rank");
}

}  // namespace
}  // namespace odyssey::engine
