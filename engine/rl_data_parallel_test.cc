// Data-parallel RL calls: two ranks (threads over the in-process communicator), each with a
// contiguous slice of a batch, equal one rank with the whole batch (logprobs, summed losses,
// parameters after OptimStep), stay bitwise identical, and agree on refusals and failures.
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/parallel/communicator.h"
#include "engine/parallel/parallel_testing.h"
#include "engine/rl_loss.h"
#include "engine/rl_test_batch.h"
#include "engine/trainer.h"

namespace odyssey::engine {
namespace {

using parallel_testing::CopyWeights;

constexpr int64_t kVocab = 256;  // the tiny model's byte vocabulary

TrainerOptions TinyCpu() {
  TrainerOptions o;
  o.model = "tiny";
  o.device = "cpu";
  o.dtype = "float32";
  o.seed = 5;
  o.data.format = "random";  // RL calls bring their own data
  o.data.seq_len = 16;
  o.grad_clip = 0.05;        // low enough to clip: clipping must see the reduced gradients
  o.rl_group_tokens = 40;    // the whole batch runs in two padded groups, the slices differently
  return o;
}

AdamWOptions Adam() {
  AdamWOptions a;
  a.lr = 1e-2;
  a.weight_decay = 0.1;
  return a;
}

// Two data-parallel ranks (created together: Create broadcasts rank 0's weights) and a single-rank
// reference with the same weights.
struct World {
  std::shared_ptr<InProcessGroup> group;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<Trainer>> ranks;
  std::unique_ptr<Trainer> single;
};

// Runs fn(rank) on one thread per rank and waits for all.
void OnRanks(int world_size, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

World MakeWorld() {
  World w;
  w.group = InProcessGroup::Create(2, absl::Seconds(60));
  for (int r = 0; r < 2; ++r) w.comms.push_back(w.group->Rank(r));
  w.ranks.resize(2);
  std::vector<absl::Status> created(2);
  OnRanks(2, [&](int r) {
    TrainerOptions o = TinyCpu();
    o.communicator = w.comms[static_cast<size_t>(r)].get();
    absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(o);
    created[static_cast<size_t>(r)] = t.status();
    if (t.ok()) w.ranks[static_cast<size_t>(r)] = *std::move(t);
  });
  EXPECT_TRUE(created[0].ok()) << created[0];
  EXPECT_TRUE(created[1].ok()) << created[1];
  absl::StatusOr<std::unique_ptr<Trainer>> single = Trainer::Create(TinyCpu());
  EXPECT_TRUE(single.ok()) << single.status();
  if (single.ok()) w.single = *std::move(single);
  if (w.ranks[0] && w.single) CopyWeights(*w.ranks[0], *w.single);
  return w;
}

using rl_testing::ToFloats;

// Five datums of awkward lengths (engine/rl_test_batch.h says what each holds).
std::vector<Datum> RandomBatch(Trainer& trainer, uint64_t seed) {
  return rl_testing::RandomBatch(trainer, seed, /*lengths=*/{7, 12, 5, 9, 11}, kVocab);
}

std::vector<Datum> Slice(const std::vector<Datum>& batch, size_t begin, size_t end) {
  return std::vector<Datum>(batch.begin() + static_cast<std::ptrdiff_t>(begin),
                            batch.begin() + static_cast<std::ptrdiff_t>(end));
}

// Every parameter of `a` within rtol (relative to |b|) + atol of `b`'s; (0, 0) = bitwise.
void ExpectParamsClose(Trainer& a, Trainer& b, double rtol, double atol, const std::string& what) {
  auto pa = a.model()->named_parameters();
  auto pb = b.model()->named_parameters();
  for (auto& p : pa) {
    const torch::Tensor& x = p.value();
    const torch::Tensor& y = pb[p.key()];
    if (rtol == 0 && atol == 0) {
      EXPECT_TRUE(torch::equal(x, y)) << what << ": " << p.key() << " differs";
    } else {
      EXPECT_TRUE(torch::allclose(x, y, rtol, atol))
          << what << ": " << p.key() << " max |diff| " << (x - y).abs().max().item<double>();
    }
  }
}

std::vector<torch::Tensor> Snapshot(Trainer& t) {
  std::vector<torch::Tensor> out;
  for (const torch::Tensor& p : t.model()->parameters()) out.push_back(p.detach().clone());
  return out;
}

bool AnyGradient(Trainer& t) {
  for (const torch::Tensor& p : t.model()->parameters())
    if (p.grad().defined()) return true;
  return false;
}

// Per-rank ForwardBackward results and OptimStep results of one data-parallel step.
struct RankStep {
  std::vector<absl::StatusOr<ForwardBackwardResult>> fb{2, absl::UnknownError("not run")};
  std::vector<absl::StatusOr<OptimStepResult>> step{2, absl::UnknownError("not run")};
};

// Rank r gets datums [cuts[r], cuts[r + 1]) with the whole batch's W (or 0: not given).
RankStep DataParallelStep(World& w, const std::vector<Datum>& batch, const std::vector<size_t>& cuts,
                          const LossSpec& spec, bool give_weight_sum) {
  RankStep out;
  const double W = BatchWeightSum(batch);
  OnRanks(2, [&](int r) {
    const size_t i = static_cast<size_t>(r);
    RlShard shard;
    shard.weight_sum = give_weight_sum ? W : 0.0;
    shard.datum_offset = static_cast<int64_t>(cuts[i]);
    out.fb[i] = w.ranks[i]->ForwardBackward(Slice(batch, cuts[i], cuts[i + 1]), spec, shard);
    if (out.fb[i].ok()) out.step[i] = w.ranks[i]->OptimStep(Adam());
  });
  return out;
}

// Checks a data-parallel step against the single rank's step on the whole batch.
void ExpectStepEqualsSingle(World& w, const std::vector<Datum>& batch, const std::vector<size_t>& cuts,
                            const LossSpec& spec, bool give_weight_sum, const std::string& what) {
  absl::StatusOr<ForwardBackwardResult> want = w.single->ForwardBackward(batch, spec);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<OptimStepResult> want_step = w.single->OptimStep(Adam());
  ASSERT_TRUE(want_step.ok()) << want_step.status();

  RankStep got = DataParallelStep(w, batch, cuts, spec, give_weight_sum);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(got.fb[r].ok()) << what << " rank " << r << ": " << got.fb[r].status();
    ASSERT_TRUE(got.step[r].ok()) << what << " rank " << r << ": " << got.step[r].status();
  }
  // Logprobs: the ranks' concatenated equal the whole batch's (different padded groups, so
  // rounding-level differences only).
  std::vector<std::vector<float>> logprobs = got.fb[0]->logprobs;
  logprobs.insert(logprobs.end(), got.fb[1]->logprobs.begin(), got.fb[1]->logprobs.end());
  ASSERT_EQ(logprobs.size(), batch.size()) << what;
  for (size_t i = 0; i < batch.size(); ++i) {
    ASSERT_EQ(logprobs[i].size(), want->logprobs[i].size()) << what << " datum " << i;
    for (size_t t = 0; t < logprobs[i].size(); ++t)
      EXPECT_NEAR(logprobs[i][t], want->logprobs[i][t], 1e-5 * std::abs(want->logprobs[i][t]) + 1e-6)
          << what << " datum " << i << " token " << t;
  }
  // Each rank's loss is its share (its terms / the whole W): they add up to the batch loss.
  EXPECT_NEAR(got.fb[0]->loss + got.fb[1]->loss, want->loss, 1e-6 * std::abs(want->loss)) << what;
  for (size_t r = 0; r < 2; ++r) {
    // A slice's share is 0 exactly when its weights are (the loss terms select weight-0 tokens out).
    if (BatchWeightSum(Slice(batch, cuts[r], cuts[r + 1])) > 0) {
      EXPECT_NE(got.fb[r]->loss, 0) << what << " rank " << r;
    } else {
      EXPECT_EQ(got.fb[r]->loss, 0) << what << " rank " << r;
    }
  }
  EXPECT_NEAR(got.fb[0]->weight_sum, want->weight_sum, 1e-9 * want->weight_sum) << what;
  EXPECT_EQ(got.fb[0]->weight_sum, got.fb[1]->weight_sum) << what;
  EXPECT_EQ(got.fb[0]->tokens + got.fb[1]->tokens, want->tokens) << what;
  EXPECT_EQ(got.fb[0]->clipped_tokens + got.fb[1]->clipped_tokens, want->clipped_tokens) << what;
  EXPECT_EQ(got.fb[0]->mismatch.tokens + got.fb[1]->mismatch.tokens, want->mismatch.tokens) << what;
  // One update, the same on both ranks, equal to the single rank's.
  EXPECT_EQ(got.step[0]->grad_norm, got.step[1]->grad_norm) << what;
  EXPECT_NEAR(got.step[0]->grad_norm, want_step->grad_norm, 1e-5 * want_step->grad_norm) << what;
  EXPECT_GT(want_step->grad_norm, TinyCpu().grad_clip) << what << ": the clip must be active";
  EXPECT_EQ(got.step[0]->step, want_step->step) << what;
  ExpectParamsClose(*w.ranks[0], *w.ranks[1], 0, 0, what + ": rank 0 vs rank 1");
  // AdamW divides by sqrt(v): entries with near-zero gradients turn summation-order rounding into
  // update differences of ~1e-6 (atol); a wrong normalization moves weights by ~lr = 1e-2.
  ExpectParamsClose(*w.ranks[0], *w.single, 1e-5, 1e-5, what + ": data parallel vs one rank");
  EXPECT_FALSE(AnyGradient(*w.ranks[0]) || AnyGradient(*w.ranks[1])) << what << ": gradients left pending";
}

class RlDataParallelTest : public ::testing::TestWithParam<LossKind> {};

// Uneven slices (3 + 2 datums): the step equals one rank's on the whole batch, for two steps (the
// second on the updated weights, with W all-reduced instead of given).
TEST_P(RlDataParallelTest, TwoRanksEqualOneRankOnTheWholeBatch) {
  torch::set_num_threads(1);
  World w = MakeWorld();
  ASSERT_TRUE(w.ranks[0] && w.ranks[1] && w.single);
  LossSpec spec;
  spec.kind = GetParam();
  spec.clip_low = 0.2;
  spec.clip_high = 0.28;
  const std::vector<Datum> batch = RandomBatch(*w.single, /*seed=*/21);
  const std::string name = LossKindName(spec.kind);
  ExpectStepEqualsSingle(w, batch, {0, 3, 5}, spec, /*give_weight_sum=*/true, name + " step 1");
  const std::vector<Datum> next = RandomBatch(*w.single, /*seed=*/22);
  ExpectStepEqualsSingle(w, next, {0, 2, 5}, spec, /*give_weight_sum=*/false, name + " step 2 (W all-reduced)");
}

INSTANTIATE_TEST_SUITE_P(Losses, RlDataParallelTest, ::testing::Values(LossKind::kCrossEntropy, LossKind::kPpo),
                         [](const auto& info) { return LossKindName(info.param); });

// An invalid datum on rank 1 (whole-batch index 4): rank 1 names it, rank 0 says it was refused
// elsewhere, nothing runs on either rank (the gradients pending from an earlier call are kept),
// and the following valid step equals the reference.
TEST(RlDataParallelRefusalTest, InvalidDatumOnOneRankRefusesEverywhere) {
  torch::set_num_threads(1);
  World w = MakeWorld();
  ASSERT_TRUE(w.ranks[0] && w.ranks[1] && w.single);
  LossSpec ppo;
  ppo.kind = LossKind::kPpo;
  const std::vector<Datum> batch = RandomBatch(*w.single, /*seed=*/31);
  std::vector<Datum> bad = batch;
  bad[4].tokens[3] = kVocab;
  const double W = BatchWeightSum(batch);

  // Pending gradients from a valid call on both ranks, then the refused call.
  std::vector<absl::StatusOr<ForwardBackwardResult>> first(2, absl::UnknownError("not run"));
  std::vector<absl::StatusOr<ForwardBackwardResult>> refused(2, absl::UnknownError("not run"));
  std::vector<std::vector<torch::Tensor>> grads(2);
  const std::vector<size_t> cuts = {0, 3, 5};
  OnRanks(2, [&](int r) {
    const size_t i = static_cast<size_t>(r);
    RlShard shard{W, static_cast<int64_t>(cuts[i])};
    first[i] = w.ranks[i]->ForwardBackward(Slice(batch, cuts[i], cuts[i + 1]), ppo, shard);
    for (const torch::Tensor& p : w.ranks[i]->model()->parameters()) grads[i].push_back(p.grad().clone());
    refused[i] = w.ranks[i]->ForwardBackward(Slice(bad, cuts[i], cuts[i + 1]), ppo, shard);
  });
  ASSERT_TRUE(first[0].ok()) << first[0].status();
  ASSERT_TRUE(first[1].ok()) << first[1].status();
  ASSERT_FALSE(refused[1].ok());
  EXPECT_EQ(refused[1].status().code(), absl::StatusCode::kInvalidArgument) << refused[1].status();
  EXPECT_NE(refused[1].status().message().find("batch[4].tokens[3] (256) must be in [0, 256)"), std::string::npos)
      << refused[1].status();
  ASSERT_FALSE(refused[0].ok());
  EXPECT_EQ(refused[0].status().code(), absl::StatusCode::kInvalidArgument) << refused[0].status();
  EXPECT_EQ(refused[0].status().message().rfind("batch: refused on another rank", 0), 0u) << refused[0].status();
  for (size_t i = 0; i < 2; ++i) {
    const std::vector<torch::Tensor> params = w.ranks[i]->model()->parameters();
    for (size_t k = 0; k < params.size(); ++k)
      ASSERT_TRUE(params[k].grad().defined() && torch::equal(params[k].grad(), grads[i][k]))
          << "rank " << i << ": the refused call changed gradient " << k;
  }

  // OptimStep applies the valid call's gradients only: equal to the reference's step.
  ASSERT_TRUE(w.single->ForwardBackward(batch, ppo).ok());
  ASSERT_TRUE(w.single->OptimStep(Adam()).ok());
  std::vector<absl::StatusOr<OptimStepResult>> steps(2, absl::UnknownError("not run"));
  OnRanks(2, [&](int r) { steps[static_cast<size_t>(r)] = w.ranks[static_cast<size_t>(r)]->OptimStep(Adam()); });
  ASSERT_TRUE(steps[0].ok()) << steps[0].status();
  ASSERT_TRUE(steps[1].ok()) << steps[1].status();
  ExpectParamsClose(*w.ranks[0], *w.ranks[1], 0, 0, "after refusal: rank 0 vs rank 1");
  ExpectParamsClose(*w.ranks[0], *w.single, 1e-5, 1e-5, "after refusal: data parallel vs one rank");

  // Refused with nothing pending: no gradient appears, nothing moves; the next valid step still
  // equals the reference's.
  const std::vector<torch::Tensor> before = Snapshot(*w.ranks[0]);
  OnRanks(2, [&](int r) {
    const size_t i = static_cast<size_t>(r);
    refused[i] = w.ranks[i]->ForwardBackward(Slice(bad, cuts[i], cuts[i + 1]), ppo, RlShard{W, static_cast<int64_t>(cuts[i])});
  });
  EXPECT_FALSE(refused[0].ok());
  EXPECT_FALSE(refused[1].ok());
  EXPECT_FALSE(AnyGradient(*w.ranks[0]) || AnyGradient(*w.ranks[1]));
  const std::vector<torch::Tensor> after = Snapshot(*w.ranks[0]);
  for (size_t k = 0; k < before.size(); ++k) EXPECT_TRUE(torch::equal(before[k], after[k])) << "parameter " << k;
  ExpectStepEqualsSingle(w, batch, cuts, ppo, /*give_weight_sum=*/true, "valid step after the refusal");
}

// A slice whose weights are all 0 is fine when the whole batch weighs > 0; a whole batch of 0
// weights is refused on every rank alike.
TEST(RlDataParallelRefusalTest, WeightSumIsTheWholeBatchs) {
  torch::set_num_threads(1);
  World w = MakeWorld();
  ASSERT_TRUE(w.ranks[0] && w.ranks[1] && w.single);
  LossSpec ce;
  std::vector<Datum> batch = RandomBatch(*w.single, /*seed=*/41);
  for (size_t i = 3; i < 5; ++i) batch[i].weights.assign(batch[i].tokens.size(), 0.0f);
  ExpectStepEqualsSingle(w, batch, {0, 3, 5}, ce, /*give_weight_sum=*/false, "rank 1's slice weighs 0");

  for (Datum& d : batch) d.weights.assign(d.tokens.size(), 0.0f);
  RankStep got = DataParallelStep(w, batch, {0, 3, 5}, ce, /*give_weight_sum=*/false);
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(got.fb[r].ok()) << "rank " << r;
    EXPECT_EQ(got.fb[r].status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(got.fb[r].status().message().find("the weights sum to 0"), std::string::npos) << got.fb[r].status();
  }
  EXPECT_FALSE(AnyGradient(*w.ranks[0]) || AnyGradient(*w.ranks[1]));
}

// A rank with an empty slice computes nothing but takes part: the step equals the reference's.
// Forward on an empty slice returns no logprobs. A single rank still refuses empty batches.
TEST(RlDataParallelEmptySliceTest, EmptySliceOnOneRank) {
  torch::set_num_threads(1);
  World w = MakeWorld();
  ASSERT_TRUE(w.ranks[0] && w.ranks[1] && w.single);
  LossSpec ppo;
  ppo.kind = LossKind::kPpo;
  const std::vector<Datum> batch = RandomBatch(*w.single, /*seed=*/51);

  absl::StatusOr<ForwardBackwardResult> want = w.single->ForwardBackward(batch, ppo);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(w.single->OptimStep(Adam()).ok());
  RankStep got = DataParallelStep(w, batch, {0, 5, 5}, ppo, /*give_weight_sum=*/true);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(got.fb[r].ok()) << "rank " << r << ": " << got.fb[r].status();
    ASSERT_TRUE(got.step[r].ok()) << "rank " << r << ": " << got.step[r].status();
  }
  EXPECT_TRUE(got.fb[1]->logprobs.empty());
  EXPECT_EQ(got.fb[1]->loss, 0);
  EXPECT_EQ(got.fb[1]->tokens, 0);
  EXPECT_NEAR(got.fb[0]->loss, want->loss, 1e-6 * std::abs(want->loss));
  ExpectParamsClose(*w.ranks[0], *w.ranks[1], 0, 0, "empty slice: rank 0 vs rank 1");
  ExpectParamsClose(*w.ranks[0], *w.single, 1e-5, 1e-5, "empty slice: data parallel vs one rank");

  absl::StatusOr<std::vector<std::vector<float>>> none = w.ranks[1]->Forward({}, RlShard{0, 5});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
  absl::StatusOr<std::vector<std::vector<float>>> some = w.ranks[0]->Forward(Slice(batch, 0, 2));
  ASSERT_TRUE(some.ok()) << some.status();
  EXPECT_EQ(some->size(), 2u);

  EXPECT_EQ(w.single->ForwardBackward({}, ppo).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.single->Forward({}).status().code(), absl::StatusCode::kInvalidArgument);
}

// Forward is local and names a bad datum by its whole-batch index; so does ValidateBatch.
TEST(RlDataParallelRefusalTest, ForwardAndValidateBatchNameWholeBatchIndex) {
  torch::set_num_threads(1);
  World w = MakeWorld();
  ASSERT_TRUE(w.ranks[0] && w.ranks[1] && w.single);
  std::vector<Datum> batch = RandomBatch(*w.single, /*seed=*/61);
  batch[1].target_tokens[2] = -3;
  absl::StatusOr<std::vector<std::vector<float>>> f = w.ranks[1]->Forward(Slice(batch, 0, 2), RlShard{0, 7});
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("batch[8].target_tokens[2] (-3)"), std::string::npos) << f.status();
  LossSpec ce;
  absl::Status s = ValidateBatch(batch, &ce, kVocab, 4096, /*datum_offset=*/10);
  EXPECT_NE(s.message().find("batch[11].target_tokens[2] (-3) must be in [0, 256)"), std::string::npos) << s;
  EXPECT_NE(ValidateBatch(batch, &ce, kVocab, 4096).message().find("batch[1].target_tokens[2]"), std::string::npos);
}

// OptimStep with nothing pending on any rank: FAILED_PRECONDITION on both, nothing moves.
TEST(RlDataParallelOptimStepTest, NoPendingGradientsAnywhere) {
  torch::set_num_threads(1);
  World w = MakeWorld();
  ASSERT_TRUE(w.ranks[0] && w.ranks[1] && w.single);
  const std::vector<torch::Tensor> before = Snapshot(*w.ranks[0]);
  std::vector<absl::StatusOr<OptimStepResult>> steps(2, absl::UnknownError("not run"));
  OnRanks(2, [&](int r) { steps[static_cast<size_t>(r)] = w.ranks[static_cast<size_t>(r)]->OptimStep(Adam()); });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(steps[r].ok()) << "rank " << r;
    EXPECT_EQ(steps[r].status().code(), absl::StatusCode::kFailedPrecondition) << steps[r].status();
  }
  const std::vector<torch::Tensor> after = Snapshot(*w.ranks[0]);
  for (size_t k = 0; k < before.size(); ++k) EXPECT_TRUE(torch::equal(before[k], after[k])) << "parameter " << k;
  EXPECT_EQ(w.ranks[0]->step(), 0);

  // An invalid lr on one rank refuses the step on both.
  OnRanks(2, [&](int r) {
    AdamWOptions adam = Adam();
    if (r == 1) adam.lr = -1;
    steps[static_cast<size_t>(r)] = w.ranks[static_cast<size_t>(r)]->OptimStep(adam);
  });
  EXPECT_EQ(steps[1].status().code(), absl::StatusCode::kInvalidArgument) << steps[1].status();
  EXPECT_EQ(steps[0].status().code(), absl::StatusCode::kInvalidArgument) << steps[0].status();
  EXPECT_EQ(steps[0].status().message().rfind("optim_step: refused on another rank", 0), 0u) << steps[0].status();
}

// A failure while computing on one rank (here its weights hold a NaN, so its loss is not
// finite): every rank returns an error and drops its pending gradients, those of earlier calls
// included, so the next OptimStep finds none anywhere.
TEST(RlDataParallelFailureTest, ComputeFailureOnOneRankDropsGradientsEverywhere) {
  torch::set_num_threads(1);
  World w = MakeWorld();
  ASSERT_TRUE(w.ranks[0] && w.ranks[1] && w.single);
  LossSpec ce;
  const std::vector<Datum> batch = RandomBatch(*w.single, /*seed=*/71);
  const double W = BatchWeightSum(batch);
  const std::vector<size_t> cuts = {0, 3, 5};
  std::vector<absl::StatusOr<ForwardBackwardResult>> first(2, absl::UnknownError("not run"));
  std::vector<absl::StatusOr<ForwardBackwardResult>> failed(2, absl::UnknownError("not run"));
  OnRanks(2, [&](int r) {
    const size_t i = static_cast<size_t>(r);
    RlShard shard{W, static_cast<int64_t>(cuts[i])};
    first[i] = w.ranks[i]->ForwardBackward(Slice(batch, cuts[i], cuts[i + 1]), ce, shard);
    if (r == 1) {
      torch::NoGradGuard no_grad;
      w.ranks[i]->model()->parameters()[0].view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
    }
    failed[i] = w.ranks[i]->ForwardBackward(Slice(batch, cuts[i], cuts[i + 1]), ce, shard);
  });
  ASSERT_TRUE(first[0].ok()) << first[0].status();
  ASSERT_TRUE(first[1].ok()) << first[1].status();
  ASSERT_FALSE(failed[1].ok());
  EXPECT_EQ(failed[1].status().code(), absl::StatusCode::kFailedPrecondition) << failed[1].status();
  EXPECT_NE(failed[1].status().message().find("the loss is nan"), std::string::npos) << failed[1].status();
  ASSERT_FALSE(failed[0].ok());
  EXPECT_EQ(failed[0].status().code(), absl::StatusCode::kInternal) << failed[0].status();
  EXPECT_EQ(failed[0].status().message().rfind("forward_backward failed on another rank", 0), 0u) << failed[0].status();
  EXPECT_FALSE(AnyGradient(*w.ranks[0]) || AnyGradient(*w.ranks[1]));
  std::vector<absl::StatusOr<OptimStepResult>> steps(2, absl::UnknownError("not run"));
  OnRanks(2, [&](int r) { steps[static_cast<size_t>(r)] = w.ranks[static_cast<size_t>(r)]->OptimStep(Adam()); });
  EXPECT_EQ(steps[0].status().code(), absl::StatusCode::kFailedPrecondition) << steps[0].status();
  EXPECT_EQ(steps[1].status().code(), absl::StatusCode::kFailedPrecondition) << steps[1].status();
}

}  // namespace
}  // namespace odyssey::engine
