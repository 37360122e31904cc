// RL loss core: each loss's gradient equals the formula computed directly with libtorch, Forward's
// logprobs equal the validated Hidden + TokenLogprobs path, the mismatch metrics, the bad-input
// table (and the trainer still trains afterwards), and REINFORCE with PPO raising the reward of
// completions the tiny model samples itself. The sampler (engine/sampler.h): greedy decoding
// equals an argmax loop over the full forward, a seed reproduces its draws, the top-k / top-p
// filters keep what they promise, and its bad-input table.
#include "engine/rl_loss.h"
#include "engine/rl_test_batch.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "absl/strings/match.h"

#include "engine/loss.h"
#include "engine/sampler.h"
#include "engine/trainer.h"

namespace odyssey::engine {
namespace {

TrainerOptions TinyCpu(uint64_t seed) {
  TrainerOptions o;
  o.model = "tiny";
  o.device = "cpu";
  o.dtype = "float32";
  o.seed = seed;
  o.data.format = "random";  // RL calls bring their own data; no dataset is read
  o.data.seq_len = 16;
  return o;
}

// group_tokens: RL datums run in padded groups of at most this many positions (1: one at a time).
std::unique_ptr<Trainer> MakeTrainer(uint64_t seed, const std::string& recompute = "none", int64_t group_tokens = 64) {
  TrainerOptions o = TinyCpu(seed);
  o.memory.recompute = *planner::ParseRecompute(recompute);
  if (recompute == "layer") o.memory.loss_tile = 5;  // the recompute variant also tiles the logprobs
  o.rl_group_tokens = group_tokens;
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

using rl_testing::FromFloats;
using rl_testing::ToFloats;

std::vector<Datum> RandomBatch(Trainer& trainer, uint64_t seed) {
  return rl_testing::RandomBatch(trainer, seed, /*lengths=*/{7, 12, 5, 9});
}

std::vector<torch::Tensor> TakeGrads(Trainer& trainer) {
  std::vector<torch::Tensor> grads;
  for (torch::Tensor& p : trainer.model()->parameters()) {
    grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    p.mutable_grad() = torch::Tensor();
  }
  return grads;
}

struct DirectResult {
  double loss = 0;
  int64_t clipped = 0;   // ppo: weighted tokens whose gradient the clip removed
  int64_t weighted = 0;  // tokens with w > 0
};

// The loss written out from the formulas, through the model's full logits (model->Logits, not
// the trainer's path), backpropagated into the parameters' .grad.
DirectResult DirectLoss(Trainer& trainer, const std::vector<Datum>& batch, const LossSpec& spec) {
  DirectResult out;
  torch::Tensor total = torch::zeros({});
  double W = 0;
  for (const Datum& d : batch) {
    const int64_t S = static_cast<int64_t>(d.tokens.size());
    model::ForwardInputs in;
    in.input_ids = torch::tensor(d.tokens, torch::kInt64).view({1, S});
    torch::Tensor targets = torch::tensor(d.target_tokens, torch::kInt64).view({S, 1});
    torch::Tensor logits = trainer.model()->Logits(in).squeeze(0).to(torch::kFloat32);  // (S, V)
    torch::Tensor logp = torch::log_softmax(logits, -1).gather(-1, targets).squeeze(-1);  // (S,)
    torch::Tensor w = FromFloats(d.weights), q = FromFloats(d.sampler_logprobs), A = FromFloats(d.advantages);
    W += w.sum().item<double>();
    out.weighted += (w > 0).sum().item<int64_t>();
    torch::Tensor r = torch::exp(logp - q);  // (S,)
    switch (spec.kind) {
      case LossKind::kCrossEntropy:
        total = total - (w * logp).sum();
        break;
      case LossKind::kImportanceSampling:
        total = total - (w * r * A).sum();
        break;
      case LossKind::kPpo: {
        torch::Tensor clipped = torch::clamp(r, 1 - spec.clip_low, 1 + spec.clip_high);
        total = total - (w * torch::min(r * A, clipped * A)).sum();
        torch::Tensor removed = ((A > 0) & (r > 1 + spec.clip_high)) | ((A < 0) & (r < 1 - spec.clip_low));
        out.clipped += (removed & (w > 0)).sum().item<int64_t>();
        break;
      }
      default:
        ADD_FAILURE() << "no direct formula";
    }
  }
  torch::Tensor loss = total / W;
  loss.backward();
  out.loss = loss.item<double>();
  return out;
}

// (loss, memory.recompute, rl_group_tokens)
class RlLossGradientTest : public ::testing::TestWithParam<std::tuple<LossKind, std::string, int64_t>> {};

// ForwardBackward's gradient w.r.t. every parameter equals the direct formula's (fp32, relative
// 1e-5), and so does the loss; for ppo some but not all weighted tokens are clipped.
TEST_P(RlLossGradientTest, GradientEqualsDirectFormula) {
  torch::set_num_threads(2);
  const auto& [kind, recompute, group_tokens] = GetParam();
  std::unique_ptr<Trainer> trainer = MakeTrainer(/*seed=*/7, recompute, group_tokens);
  ASSERT_NE(trainer, nullptr);
  std::vector<Datum> batch = RandomBatch(*trainer, /*seed=*/11);
  LossSpec spec;
  spec.kind = kind;
  spec.clip_low = 0.2;
  spec.clip_high = 0.28;

  absl::StatusOr<ForwardBackwardResult> r = trainer->ForwardBackward(batch, spec);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<torch::Tensor> got = TakeGrads(*trainer);
  DirectResult want = DirectLoss(*trainer, batch, spec);
  std::vector<torch::Tensor> expected = TakeGrads(*trainer);

  EXPECT_NEAR(r->loss, want.loss, 1e-5 * std::abs(want.loss)) << LossKindName(kind);
  EXPECT_NEAR(r->weight_sum, BatchWeightSum(batch), 1e-6);
  auto names = trainer->model()->named_parameters();
  ASSERT_EQ(got.size(), expected.size());
  double total_norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double ref = expected[i].norm().item<double>();
    const double diff = (got[i] - expected[i]).norm().item<double>();
    total_norm += ref;
    EXPECT_LE(diff, 1e-5 * ref + 1e-12) << names[i].key() << " (" << LossKindName(kind) << "): |diff| " << diff
                                        << " vs |grad| " << ref;
  }
  EXPECT_GT(total_norm, 0);
  if (kind == LossKind::kPpo) {
    std::printf("ppo: %lld of %lld weighted tokens clipped\n", static_cast<long long>(want.clipped),
                static_cast<long long>(want.weighted));
    EXPECT_GT(want.clipped, 0);
    EXPECT_LT(want.clipped, want.weighted);
    EXPECT_EQ(r->clipped_tokens, want.clipped);
  } else {
    EXPECT_EQ(r->clipped_tokens, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Losses, RlLossGradientTest,
    // The batch's 4 datums (lengths 7, 12, 5, 9) as one padded group (64 positions), one at a
    // time (1), or two groups (30), through plain autograd and the memory stack's layer recompute.
    ::testing::Values(std::make_tuple(LossKind::kCrossEntropy, std::string("none"), int64_t{64}),
                      std::make_tuple(LossKind::kImportanceSampling, std::string("none"), int64_t{64}),
                      std::make_tuple(LossKind::kPpo, std::string("none"), int64_t{64}),
                      std::make_tuple(LossKind::kPpo, std::string("none"), int64_t{1}),
                      std::make_tuple(LossKind::kImportanceSampling, std::string("layer"), int64_t{30})),
    [](const auto& info) {
      return LossKindName(std::get<0>(info.param)) + "_recompute_" + std::get<1>(info.param) + "_group_" +
             std::to_string(std::get<2>(info.param));
    });

// Gradients of successive ForwardBackward calls add up until OptimStep: two calls give the sum
// of the gradients each gives alone (each normalized by its own batch's weights).
TEST(RlAccumulationTest, SuccessiveCallsAddGradients) {
  torch::set_num_threads(2);
  std::unique_ptr<Trainer> trainer = MakeTrainer(/*seed=*/8);
  ASSERT_NE(trainer, nullptr);
  const std::vector<Datum> a = RandomBatch(*trainer, /*seed=*/1), b = RandomBatch(*trainer, /*seed=*/2);
  LossSpec ppo;
  ppo.kind = LossKind::kPpo;
  ASSERT_TRUE(trainer->ForwardBackward(a, ppo).ok());
  std::vector<torch::Tensor> ga = TakeGrads(*trainer);
  ASSERT_TRUE(trainer->ForwardBackward(b, ppo).ok());
  std::vector<torch::Tensor> gb = TakeGrads(*trainer);
  ASSERT_TRUE(trainer->ForwardBackward(a, ppo).ok());
  ASSERT_TRUE(trainer->ForwardBackward(b, ppo).ok());
  std::vector<torch::Tensor> both = TakeGrads(*trainer);
  for (size_t i = 0; i < both.size(); ++i) {
    const torch::Tensor want = ga[i] + gb[i];
    EXPECT_LE((both[i] - want).norm().item<double>(), 1e-6 * want.norm().item<double>() + 1e-12) << i;
  }
}

// A wild sampler logprob (finite but absurd, as a broken inference engine might send) neither
// poisons the gradients with NaN nor stops the session: log r is clamped.
TEST(RlRobustnessTest, ExtremeSamplerLogprobKeepsGradientsFinite) {
  torch::set_num_threads(2);
  std::unique_ptr<Trainer> trainer = MakeTrainer(/*seed=*/6);
  ASSERT_NE(trainer, nullptr);
  std::vector<Datum> batch = RandomBatch(*trainer, /*seed=*/3);
  batch[1].sampler_logprobs[4] = -1e30f;
  batch[1].weights[4] = 1;
  batch[2].sampler_logprobs[3] = -1e30f;
  batch[2].weights[3] = 0;
  for (LossKind kind : {LossKind::kImportanceSampling, LossKind::kPpo}) {
    LossSpec spec;
    spec.kind = kind;
    absl::StatusOr<ForwardBackwardResult> r = trainer->ForwardBackward(batch, spec);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(std::isfinite(r->loss)) << LossKindName(kind);
    for (const torch::Tensor& p : trainer->model()->parameters())
      EXPECT_TRUE(torch::isfinite(p.grad()).all().item<bool>()) << LossKindName(kind);
    AdamWOptions adam;
    absl::StatusOr<OptimStepResult> step = trainer->OptimStep(adam);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_TRUE(std::isfinite(step->grad_norm));
  }
}

// Forward's logprobs equal model->Hidden + engine::TokenLogprobs (the path hf_parity validates
// against transformers), and ForwardBackward returns the same ones.
TEST(RlForwardTest, LogprobsEqualHiddenPlusTokenLogprobs) {
  torch::set_num_threads(2);
  std::unique_ptr<Trainer> trainer = MakeTrainer(/*seed=*/3);
  ASSERT_NE(trainer, nullptr);
  std::vector<Datum> batch = RandomBatch(*trainer, /*seed=*/5);
  absl::StatusOr<std::vector<std::vector<float>>> logp = trainer->Forward(batch);
  ASSERT_TRUE(logp.ok()) << logp.status();
  LossSpec ce;
  absl::StatusOr<ForwardBackwardResult> fb = trainer->ForwardBackward(batch, ce);
  ASSERT_TRUE(fb.ok()) << fb.status();
  torch::NoGradGuard no_grad;
  ASSERT_EQ(logp->size(), batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const int64_t S = static_cast<int64_t>(batch[i].tokens.size());
    model::ForwardInputs in;
    in.input_ids = torch::tensor(batch[i].tokens, torch::kInt64).view({1, S});
    torch::Tensor hidden = trainer->model()->Hidden(in);  // (1, S, hidden)
    torch::Tensor want = TokenLogprobs(hidden, trainer->model()->HeadWeight(),
                                       torch::tensor(batch[i].target_tokens, torch::kInt64).view({1, S}))
                             .squeeze(0);  // (S,)
    ASSERT_EQ(static_cast<int64_t>((*logp)[i].size()), S);
    EXPECT_LE((FromFloats((*logp)[i]) - want).abs().max().item<double>(), 1e-6) << "datum " << i;
    EXPECT_LE((FromFloats(fb->logprobs[i]) - want).abs().max().item<double>(), 1e-6) << "datum " << i;
  }
}

// Mismatch: mean and max |logp - q| over tokens with w > 0 of the datums with sampler logprobs.
TEST(RlMismatchTest, ConstructedExample) {
  Mismatch m;
  DatumTensors a;
  a.weights = torch::tensor({1.0f, 0.0f, 1.0f, 2.0f});
  a.sampler_logprobs = torch::tensor({-1.5f, -9.0f, -1.0f, -4.25f});
  // |delta| = 0.5, (7: weight 0, not counted), 2, 0.25
  m.Add(torch::tensor({-1.0f, -2.0f, -3.0f, -4.0f}), a);
  DatumTensors no_sampler;  // cross_entropy datum without sampler logprobs: not counted
  no_sampler.weights = torch::ones({2});
  m.Add(torch::tensor({-5.0f, -6.0f}), no_sampler);
  EXPECT_EQ(m.tokens, 3);
  EXPECT_NEAR(m.mean_abs(), 2.75 / 3, 1e-6);
  EXPECT_NEAR(m.max_abs, 2.0, 1e-6);
  EXPECT_EQ(Mismatch().mean_abs(), 0.0);
}

// The same through ForwardBackward: sampler logprobs = the trainer's own + known offsets.
TEST(RlMismatchTest, ReportedByForwardBackward) {
  torch::set_num_threads(2);
  std::unique_ptr<Trainer> trainer = MakeTrainer(/*seed=*/4);
  ASSERT_NE(trainer, nullptr);
  Datum d;
  d.tokens = {10, 20, 30, 40, 50};
  d.target_tokens = {20, 30, 40, 50, 60};
  d.weights = {0, 1, 1, 0.5f, 1};
  absl::StatusOr<std::vector<std::vector<float>>> logp = trainer->Forward({d});
  ASSERT_TRUE(logp.ok()) << logp.status();
  const std::vector<float> offset = {5.0f, 0.1f, -0.3f, 0.05f, -0.2f};  // position 0 has weight 0
  d.sampler_logprobs = (*logp)[0];
  for (size_t t = 0; t < offset.size(); ++t) d.sampler_logprobs[t] -= offset[t];
  d.advantages = {1, 1, 1, 1, 1};
  LossSpec spec;
  spec.kind = LossKind::kImportanceSampling;
  absl::StatusOr<ForwardBackwardResult> r = trainer->ForwardBackward({d}, spec);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->mismatch.tokens, 4);
  EXPECT_NEAR(r->mismatch.mean_abs(), (0.1 + 0.3 + 0.05 + 0.2) / 4, 1e-5);
  EXPECT_NEAR(r->mismatch.max_abs, 0.3, 1e-5);
}

struct BadCase {
  std::string name;
  std::function<void(std::vector<Datum>&, LossSpec&)> mutate;
  std::string field;  // the field with its datum (and token) index
  std::string rule;
};

// Every bad batch gets INVALID_ARGUMENT naming field, datum index and rule, changes nothing
// (no gradient is left pending), and the trainer trains normally afterwards.
TEST(RlBadInputTest, TableThenStillTrains) {
  torch::set_num_threads(2);
  std::unique_ptr<Trainer> trainer = MakeTrainer(/*seed=*/9);
  ASSERT_NE(trainer, nullptr);
  const std::vector<Datum> good = RandomBatch(*trainer, /*seed=*/13);
  LossSpec ppo;
  ppo.kind = LossKind::kPpo;
  const float nan = std::nanf("");
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<BadCase> cases = {
      {"empty batch", [](auto& b, auto&) { b.clear(); }, "batch: empty", "at least one datum"},
      {"token above vocab", [](auto& b, auto&) { b[1].tokens[2] = 256; }, "batch[1].tokens[2] (256)", "must be in [0, 256)"},
      {"negative target", [](auto& b, auto&) { b[0].target_tokens[0] = -1; }, "batch[0].target_tokens[0] (-1)",
       "must be in [0, 256)"},
      {"empty tokens", [](auto& b, auto&) { b[2].tokens.clear(); }, "batch[2].tokens", "needs >= 1 token"},
      {"too long", [](auto& b, auto&) { b[3].tokens.assign(4097, 1); }, "batch[3].tokens: length (4097)",
       "must be <= 4096"},
      {"targets too short", [](auto& b, auto&) { b[3].target_tokens.pop_back(); }, "batch[3].target_tokens: length (8)",
       "must equal the length of tokens (9)"},
      {"weights too long", [](auto& b, auto&) { b[2].weights.push_back(1); }, "batch[2].weights: length (6)",
       "must equal the length of tokens (5)"},
      {"advantages too short", [](auto& b, auto&) { b[1].advantages.resize(3); }, "batch[1].advantages: length (3)",
       "must equal the length of tokens (12)"},
      {"sampler logprobs too long", [](auto& b, auto&) { b[0].sampler_logprobs.push_back(-1); },
       "batch[0].sampler_logprobs: length (8)", "must equal the length of tokens (7)"},
      {"nan advantage", [nan](auto& b, auto&) { b[1].advantages[3] = nan; }, "batch[1].advantages[3] (nan)",
       "must be finite"},
      {"inf advantage", [inf](auto& b, auto&) { b[2].advantages[0] = -inf; }, "batch[2].advantages[0] (-inf)",
       "must be finite"},
      {"inf sampler logprob", [inf](auto& b, auto&) { b[0].sampler_logprobs[1] = inf; },
       "batch[0].sampler_logprobs[1] (inf)", "must be finite"},
      {"nan weight", [nan](auto& b, auto&) { b[3].weights[4] = nan; }, "batch[3].weights[4] (nan)", "must be finite"},
      {"negative weight", [](auto& b, auto&) { b[2].weights[1] = -0.5f; }, "batch[2].weights[1] (-0.5)", "must be >= 0"},
      {"zero weights", [](auto& b, auto&) { for (auto& d : b) d.weights.assign(d.tokens.size(), 0.0f); },
       "batch: the weights", "sum to 0"},
      {"unknown loss kind", [](auto&, auto& s) { s.kind = static_cast<LossKind>(7); }, "loss.kind (unknown(7))",
       "is not a known loss"},
      {"unspecified loss kind", [](auto&, auto& s) { s.kind = LossKind::kUnspecified; }, "loss.kind (unspecified)",
       "is not a known loss"},
      {"ppo without sampler logprobs", [](auto& b, auto&) { b[1].sampler_logprobs.clear(); },
       "batch[1].sampler_logprobs", "required by loss ppo"},
      {"importance sampling without advantages",
       [](auto& b, auto& s) {
         s.kind = LossKind::kImportanceSampling;
         b[3].advantages.clear();
       },
       "batch[3].advantages", "required by loss importance_sampling"},
      {"clip_low >= 1", [](auto&, auto& s) { s.clip_low = 1.5; }, "loss.clip_low (1.5)", "must be in (0, 1)"},
      {"clip_low 0", [](auto&, auto& s) { s.clip_low = 0; }, "loss.clip_low (0)", "must be in (0, 1)"},
      {"clip_high negative", [](auto&, auto& s) { s.clip_high = -0.1; }, "loss.clip_high (-0.1)", "must be in (0, 1e6]"},
      {"clip_high inf", [inf](auto&, auto& s) { s.clip_high = inf; }, "loss.clip_high (inf)", "must be in (0, 1e6]"},
      {"clip_high huge", [](auto&, auto& s) { s.clip_high = 1e300; }, "loss.clip_high (1e+300)", "must be in (0, 1e6]"},
      {"huge advantage", [](auto& b, auto&) { b[1].advantages[2] = 3e38f; }, "batch[1].advantages[2] (3e+38)",
       "must be within [-1e6, 1e6]"},
      {"huge weight", [](auto& b, auto&) { b[0].weights[0] = 2e6f; }, "batch[0].weights[0] (2e+06)",
       "must be within [-1e6, 1e6]"},
  };
  for (const BadCase& c : cases) {
    std::vector<Datum> batch = good;
    LossSpec spec = ppo;
    c.mutate(batch, spec);
    absl::StatusOr<ForwardBackwardResult> r = trainer->ForwardBackward(batch, spec);
    ASSERT_FALSE(r.ok()) << c.name;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << r.status();
    const std::string message(r.status().message());
    EXPECT_NE(message.find(c.field), std::string::npos) << c.name << ": " << message;
    EXPECT_NE(message.find(c.rule), std::string::npos) << c.name << ": " << message;
  }
  // Forward checks the tokens too.
  std::vector<Datum> bad = good;
  bad[2].target_tokens[1] = 1000;
  absl::StatusOr<std::vector<std::vector<float>>> f = trainer->Forward(bad);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("batch[2].target_tokens[1] (1000) must be in [0, 256)"), std::string::npos)
      << f.status();
  absl::StatusOr<LossKind> parsed = ParseLossKind("reinforce");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("loss.kind 'reinforce' is not a known loss"), std::string::npos);
  EXPECT_EQ(*ParseLossKind("ppo"), LossKind::kPpo);

  // The bad batches left no gradients behind.
  AdamWOptions adam;
  adam.lr = 1e-2;
  adam.weight_decay = 0;
  absl::StatusOr<OptimStepResult> none = trainer->OptimStep(adam);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition) << none.status();
  for (const auto& p : trainer->model()->parameters()) EXPECT_FALSE(p.grad().defined());
  AdamWOptions bad_adam = adam;
  bad_adam.lr = -1;
  EXPECT_EQ(trainer->OptimStep(bad_adam).status().code(), absl::StatusCode::kInvalidArgument);

  // It still trains: a good ForwardBackward + OptimStep lowers the same batch's loss.
  absl::StatusOr<ForwardBackwardResult> before = trainer->ForwardBackward(good, ppo);
  ASSERT_TRUE(before.ok()) << before.status();
  absl::StatusOr<OptimStepResult> step = trainer->OptimStep(adam);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->step, 1);
  EXPECT_GT(step->grad_norm, 0);
  for (const auto& p : trainer->model()->parameters()) EXPECT_FALSE(p.grad().defined());
  absl::StatusOr<ForwardBackwardResult> after = trainer->ForwardBackward(good, ppo);
  ASSERT_TRUE(after.ok()) << after.status();
  std::printf("ppo loss %.6f -> %.6f after one step\n", before->loss, after->loss);
  EXPECT_LT(after->loss, before->loss);
}

// REINFORCE with the PPO loss: the tiny model samples completions of a prompt itself
// (multinomial on the softmax of the last position's logits), reward = bytes equal to a target
// string at the same position, per-token advantages against the group's mean. The mean reward of
// the last iterations is above that of the first: from ~0.1 to 1 with this seed, where the model
// settles on one byte ('!') at every position, matching one of the three; it generalizes across
// positions faster than it tells them apart and, with no entropy or KL term, stops exploring.
TEST(RlLearningTest, PpoRaisesRewardOfOwnSamples) {
  torch::set_num_threads(2);
  std::unique_ptr<Trainer> trainer = MakeTrainer(/*seed=*/21, "none", /*group_tokens=*/1024);
  ASSERT_NE(trainer, nullptr);
  torch::manual_seed(1234);
  const std::string prompt = "Q: greet\nA: ";
  const std::string target = "hi!";
  const int64_t P = static_cast<int64_t>(prompt.size()), L = static_cast<int64_t>(target.size());
  const int64_t N = 32;  // completions per iteration
  const int iterations = 40, K = 8;
  LossSpec ppo;
  ppo.kind = LossKind::kPpo;
  AdamWOptions adam;
  adam.lr = 1e-2;
  adam.weight_decay = 0;
  std::vector<double> mean_reward;
  double max_mismatch = 0;
  for (int it = 0; it < iterations; ++it) {
    torch::Tensor seq = torch::empty({N, P}, torch::kInt64);  // (N, P + generated)
    for (int64_t i = 0; i < P; ++i) seq.select(1, i).fill_(static_cast<int64_t>(static_cast<uint8_t>(prompt[i])));
    torch::Tensor sampler_logp = torch::empty({N, L});  // (N, L)
    {
      torch::NoGradGuard no_grad;
      for (int64_t k = 0; k < L; ++k) {
        model::ForwardInputs in;
        in.input_ids = seq;
        torch::Tensor logits = trainer->model()->Logits(in).select(1, -1).to(torch::kFloat32);  // (N, V)
        torch::Tensor next = torch::multinomial(torch::softmax(logits, -1), 1);               // (N, 1)
        sampler_logp.select(1, k).copy_(torch::log_softmax(logits, -1).gather(1, next).squeeze(1));
        seq = torch::cat({seq, next}, 1);
      }
    }
    torch::Tensor want = torch::tensor(std::vector<int64_t>(target.begin(), target.end()), torch::kInt64);  // (L,)
    torch::Tensor match = (seq.slice(1, P, P + L) == want.unsqueeze(0)).to(torch::kFloat32);  // (N, L)
    const double mean = match.sum(1).mean().item<double>();
    // The reward (matching bytes) is a sum over positions, so each token's advantage is its own
    // match minus the group's mean at that position (a per-token baseline): a byte is not
    // credited for its neighbours' luck.
    torch::Tensor advantage = match - match.mean(0, /*keepdim=*/true);  // (N, L)
    mean_reward.push_back(mean);
    std::vector<Datum> batch;
    for (int64_t n = 0; n < N; ++n) {
      Datum d;
      const int64_t* ids = seq[n].contiguous().data_ptr<int64_t>();
      const int64_t S = P + L - 1;
      d.tokens.assign(ids, ids + S);
      d.target_tokens.assign(ids + 1, ids + S + 1);
      d.weights.assign(S, 0.0f);
      d.sampler_logprobs.assign(S, 0.0f);
      d.advantages.assign(S, 0.0f);
      for (int64_t k = 0; k < L; ++k) {  // position P - 1 + k predicts completion byte k
        d.weights[P - 1 + k] = 1;
        d.sampler_logprobs[P - 1 + k] = sampler_logp[n][k].item<float>();
        d.advantages[P - 1 + k] = advantage[n][k].item<float>();
      }
      batch.push_back(std::move(d));
    }
    absl::StatusOr<ForwardBackwardResult> fb = trainer->ForwardBackward(batch, ppo);
    ASSERT_TRUE(fb.ok()) << fb.status();
    max_mismatch = std::max(max_mismatch, fb->mismatch.max_abs);
    absl::StatusOr<OptimStepResult> step = trainer->OptimStep(adam);
    ASSERT_TRUE(step.ok()) << step.status();
  }
  double first = 0, last = 0;
  for (int i = 0; i < K; ++i) {
    first += mean_reward[i] / K;
    last += mean_reward[iterations - K + i] / K;
  }
  std::printf("mean reward (of %lld bytes): first %d iterations %.3f, last %d %.3f; max mismatch %.2e\n",
              static_cast<long long>(L), K, first, K, last, max_mismatch);
  EXPECT_GT(last, first + 0.5);
  // The sampler is the trainer's own model: its logprobs agree up to fp32 rounding.
  EXPECT_LT(max_mismatch, 1e-4);
}

// On a GPU in bf16 (the backend's attention, padded groups): ForwardBackward's logprobs and
// parameter gradients agree with the fp32 CPU run on the same weights to bf16 precision.
TEST(RlGpuTest, Bf16ForwardBackwardTracksFp32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  TrainerOptions o = TinyCpu(/*seed=*/7);
  o.device = "cuda";
  o.dtype = "bfloat16";
  o.rl_group_tokens = 64;
  absl::StatusOr<std::unique_ptr<Trainer>> gpu = Trainer::Create(o);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::unique_ptr<Trainer> cpu = MakeTrainer(/*seed=*/7);
  ASSERT_NE(cpu, nullptr);
  {
    torch::NoGradGuard no_grad;
    auto from = (*gpu)->model()->named_parameters();
    for (auto& p : cpu->model()->named_parameters()) p.value().copy_(from[p.key()].to(torch::kCPU, torch::kFloat32));
  }
  std::vector<Datum> batch = RandomBatch(*cpu, /*seed=*/11);
  LossSpec ppo;
  ppo.kind = LossKind::kPpo;
  absl::StatusOr<ForwardBackwardResult> want = cpu->ForwardBackward(batch, ppo);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<ForwardBackwardResult> got = (*gpu)->ForwardBackward(batch, ppo);
  ASSERT_TRUE(got.ok()) << got.status();
  double max_logp = 0;
  for (size_t i = 0; i < batch.size(); ++i)
    max_logp = std::max(max_logp, (FromFloats(got->logprobs[i]) - FromFloats(want->logprobs[i])).abs().max().item<double>());
  std::vector<torch::Tensor> g = TakeGrads(**gpu), w = TakeGrads(*cpu);
  torch::Tensor gv = torch::cat([&] {
    std::vector<torch::Tensor> v;
    for (auto& t : g) v.push_back(t.to(torch::kCPU, torch::kFloat32).flatten());
    return v;
  }());
  torch::Tensor wv = torch::cat([&] {
    std::vector<torch::Tensor> v;
    for (auto& t : w) v.push_back(t.flatten());
    return v;
  }());
  const double cosine = (gv * wv).sum().item<double>() / (gv.norm() * wv.norm()).item<double>();
  const double rel = (gv - wv).norm().item<double>() / wv.norm().item<double>();
  std::printf("bf16 gpu vs fp32 cpu: max |dlogp| %.4f, loss %.6f vs %.6f, grad cosine %.5f, rel %.4f, clipped %lld vs %lld\n",
              max_logp, got->loss, want->loss, cosine, rel, static_cast<long long>(got->clipped_tokens),
              static_cast<long long>(want->clipped_tokens));
  EXPECT_LT(max_logp, 0.1);
  EXPECT_GT(cosine, 0.99);
  AdamWOptions adam;
  ASSERT_TRUE((*gpu)->OptimStep(adam).ok());
}

// --- The sampler (engine/sampler.h) ---------------------------------------------------------

SampleSpec Spec(std::vector<std::vector<int64_t>> prompts, int64_t max_tokens) {
  SampleSpec s;
  s.prompts = std::move(prompts);
  s.max_tokens = max_tokens;
  return s;
}

// Greedy sampling through the KV cache equals argmax decoding with the full forward over the
// growing sequence, stops after a stop token, and reports the forward's logprob of each token.
TEST(SamplerTest, GreedyEqualsArgmaxOverTheFullForward) {
  std::unique_ptr<Trainer> t = MakeTrainer(11);
  model::CausalLM& m = t->model();
  SampleSpec spec = Spec({{3, 1, 4, 1, 5}, {9, 2}}, 6);
  spec.temperature = 0;
  spec.num_samples = 2;
  absl::StatusOr<SampleResult> r = Sample(m, spec, {});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->sequences.size(), 4u);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < r->sequences.size(); ++i) {
    const SampledSequence& s = r->sequences[i];
    EXPECT_EQ(s.prompt_index, static_cast<int64_t>(i / 2));
    std::vector<int64_t> seq = spec.prompts[i / 2];
    ASSERT_EQ(s.tokens.size(), 6u);
    for (size_t j = 0; j < s.tokens.size(); ++j) {
      model::ForwardInputs in;
      in.input_ids = torch::tensor(seq, torch::kInt64).unsqueeze(0);
      torch::Tensor logits = m->Logits(in)[0][-1];  // (V,)
      EXPECT_EQ(s.tokens[j], logits.argmax().item<int64_t>()) << "sequence " << i << " token " << j;
      EXPECT_NEAR(s.logprobs[j], logits.log_softmax(-1)[s.tokens[j]].item<float>(), 1e-5);
      seq.push_back(s.tokens[j]);
    }
    EXPECT_FALSE(s.stopped);
  }
  // A stop token ends the sequence after emitting it.
  spec.stop_tokens = {r->sequences[0].tokens[2]};
  absl::StatusOr<SampleResult> stopped = Sample(m, spec, {});
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_TRUE(stopped->sequences[0].stopped);
  const size_t first = static_cast<size_t>(std::find(r->sequences[0].tokens.begin(), r->sequences[0].tokens.end(),
                                                     spec.stop_tokens[0]) - r->sequences[0].tokens.begin());
  EXPECT_EQ(stopped->sequences[0].tokens,
            std::vector<int64_t>(r->sequences[0].tokens.begin(), r->sequences[0].tokens.begin() + first + 1));
}

// The same seed gives the same tokens; another seed other tokens; the draws follow the filtered
// distribution (top-k: only the k best tokens appear; top-p: only the nucleus).
TEST(SamplerTest, SeededAndFiltered) {
  std::unique_ptr<Trainer> t = MakeTrainer(12);
  SampleSpec spec = Spec({{1, 2, 3}, {4}}, 12);
  spec.num_samples = 3;
  spec.seed = 7;
  auto tokens = [&](const SampleSpec& s) {
    absl::StatusOr<SampleResult> r = Sample(t->model(), s, {});
    EXPECT_TRUE(r.ok()) << r.status();
    std::vector<std::vector<int64_t>> out;
    for (const SampledSequence& q : r->sequences) out.push_back(q.tokens);
    return out;
  };
  const auto a = tokens(spec);
  EXPECT_EQ(a, tokens(spec));
  SampleSpec other = spec;
  other.seed = 8;
  EXPECT_NE(a, tokens(other));
  EXPECT_NE(a[0], a[1]);  // the samples of one prompt differ (a random model spreads its mass)

  torch::Tensor logits = torch::tensor({{0.0f, 3.0f, 1.0f, 2.9f, -1.0f}});  // (1, 5)
  SampleSpec f = Spec({{1}}, 1);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  std::set<int64_t> seen;
  f.top_k = 2;
  for (int i = 0; i < 200; ++i) seen.insert(ChooseTokens(logits, f, gen)[0].item<int64_t>());
  EXPECT_EQ(seen, (std::set<int64_t>{1, 3}));
  // Softmax of the logits: token 1 holds 0.474, token 3 0.429, token 2 0.064: top_p 0.45 keeps
  // token 1 alone, 0.6 adds token 3 (and not token 2: 0.903 was reached before it).
  f.top_k = 0;
  f.top_p = 0.45;
  seen.clear();
  for (int i = 0; i < 100; ++i) seen.insert(ChooseTokens(logits, f, gen)[0].item<int64_t>());
  EXPECT_EQ(seen, (std::set<int64_t>{1}));
  f.top_p = 0.6;
  seen.clear();
  for (int i = 0; i < 200; ++i) seen.insert(ChooseTokens(logits, f, gen)[0].item<int64_t>());
  EXPECT_EQ(seen, (std::set<int64_t>{1, 3}));
  f.temperature = 0;
  EXPECT_EQ(ChooseTokens(logits, f, gen)[0].item<int64_t>(), 1);
}

TEST(SamplerTest, BadInputNamesTheFieldAndTheRule) {
  std::unique_ptr<Trainer> t = MakeTrainer(13);
  const int64_t V = t->model()->config().vocab_size, max_pos = t->model()->config().max_position_embeddings;
  struct Case {
    std::function<void(SampleSpec&)> edit;
    std::string field, rule;
  };
  const std::vector<Case> cases = {
      {[](SampleSpec& s) { s.prompts.clear(); }, "prompts", "at least one prompt"},
      {[](SampleSpec& s) { s.prompts.push_back({}); }, "prompts[1]", "at least one token"},
      {[V](SampleSpec& s) { s.prompts[0][1] = V; }, "prompts[0][1]", "token id in [0, 256)"},
      {[](SampleSpec& s) { s.prompts[0][0] = -1; }, "prompts[0][0]", "token id in"},
      {[](SampleSpec& s) { s.num_samples = 0; }, "num_samples", ">= 1"},
      {[](SampleSpec& s) { s.max_tokens = 0; }, "params.max_tokens", ">= 1"},
      {[max_pos](SampleSpec& s) { s.max_tokens = max_pos; }, "prompts[0]", "max_position_embeddings"},
      {[](SampleSpec& s) { s.temperature = -0.5; }, "params.temperature", ">= 0"},
      {[](SampleSpec& s) { s.temperature = std::nan(""); }, "params.temperature", "finite"},
      {[](SampleSpec& s) { s.top_p = 0; }, "params.top_p", "(0, 1]"},
      {[](SampleSpec& s) { s.top_p = 1.5; }, "params.top_p", "(0, 1]"},
      {[](SampleSpec& s) { s.top_k = -1; }, "params.top_k", ">= 0"},
      {[V](SampleSpec& s) { s.stop_tokens = {1, V + 3}; }, "params.stop_tokens[1]", "token id in"},
      {[](SampleSpec& s) { s.num_samples = 40; }, "prompts", "limit of 64 positions"},
  };
  for (const Case& c : cases) {
    SampleSpec s = Spec({{1, 2, 3}}, 4);
    c.edit(s);
    absl::StatusOr<SampleResult> r = Sample(t->model(), s, SamplerLimits{64});
    ASSERT_FALSE(r.ok()) << c.field;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_TRUE(absl::StartsWith(r.status().message(), c.field + " ")) << r.status();
    EXPECT_NE(r.status().message().find(c.rule), std::string::npos) << r.status();
  }
  EXPECT_TRUE(Sample(t->model(), Spec({{1, 2, 3}}, 4), SamplerLimits{64}).ok());
}

// The hybrid family decodes through its own caches (model/decode.h: KDA's state and conv window,
// DSA's keys, values and pooled indexer keys): greedy sampling equals argmax over the full forward
// past the point where the DSA layer's selection is truly sparse (hybrid-tiny keeps 16 keys +
// tail), prompts of lengths on both sides of a pool's edge, several samples per prompt.
TEST(SamplerTest, HybridGreedyEqualsArgmaxOverTheFullForward) {
  model::CausalLM m(model::NamedShape("hybrid-tiny").value());
  m->InitRandom(13, 0.2);
  SampleSpec spec = Spec({{3, 1, 4, 1, 5, 9, 2}, {9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2}}, 24);
  spec.temperature = 0;
  spec.num_samples = 2;
  absl::StatusOr<SampleResult> r = Sample(m, spec, SamplerLimits{256});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->sequences.size(), 4u);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < r->sequences.size(); ++i) {
    const SampledSequence& s = r->sequences[i];
    std::vector<int64_t> seq = spec.prompts[i / 2];
    ASSERT_EQ(s.tokens.size(), 24u);
    model::ForwardInputs in;
    std::vector<int64_t> whole = seq;
    whole.insert(whole.end(), s.tokens.begin(), s.tokens.end());
    in.input_ids = torch::tensor(whole, torch::kInt64).unsqueeze(0);
    const torch::Tensor logits = m->Logits(in)[0];  // (L, V): the training forward, causal
    for (size_t j = 0; j < s.tokens.size(); ++j) {
      const torch::Tensor at = logits[static_cast<int64_t>(seq.size() + j) - 1];
      EXPECT_EQ(s.tokens[j], at.argmax().item<int64_t>()) << "sequence " << i << " token " << j;
      EXPECT_NEAR(s.logprobs[j], at.log_softmax(-1)[s.tokens[j]].item<float>(), 1e-4) << "sequence " << i << " token " << j;
    }
    if (i % 2 == 1) {
      EXPECT_EQ(s.tokens, r->sequences[i - 1].tokens) << "greedy samples of one prompt agree";
    }
  }
}

}  // namespace
}  // namespace odyssey::engine
