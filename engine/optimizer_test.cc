#include "engine/optimizer.h"

#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace odyssey::engine {
namespace {

// Our AdamW on fp32 params follows torch.optim.AdamW exactly (for params of 2+ dims, which
// are the ones that get weight decay; 1-D params get none).
TEST(AdamWTest, MatchesTorchAdamWInFp32) {
  torch::manual_seed(0);
  torch::Tensor a = torch::randn({7, 5}, torch::requires_grad());
  torch::Tensor b = a.detach().clone().requires_grad_(true);
  const torch::Tensor a0 = a.detach().clone();
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  AdamW ours({{"w", a}}, o);
  torch::optim::AdamW ref({b}, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  for (int step = 0; step < 6; ++step) {
    torch::Tensor g = torch::randn({7, 5});
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    ours.Step(o.lr);
    ref.step();
  }
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-6);
  EXPECT_GT((a - a0).abs().max().item<double>(), 1e-3) << "six steps of lr 1e-2 moved the parameter";
}

// Weight decay applies to matrices (2+ dims) only: norms' weights and biases (1-D) get none,
// as in Hugging Face's and torchtitan's recipes. With zero gradients Adam's update is exactly
// zero, so all that moves a parameter is decay: a matrix shrinks by (1 - lr * wd) per step, a
// vector does not move at all. The 1-D parameter then follows torch.optim.AdamW with
// weight_decay 0 under random gradients.
TEST(AdamWTest, WeightDecayOnlyOnParametersOfTwoOrMoreDims) {
  torch::manual_seed(4);
  torch::Tensor w = torch::randn({6, 3}, torch::requires_grad());
  torch::Tensor conv = torch::randn({2, 3, 4}, torch::requires_grad());
  torch::Tensor norm = torch::randn({6}, torch::requires_grad());
  const torch::Tensor w0 = w.detach().clone(), conv0 = conv.detach().clone(), norm0 = norm.detach().clone();
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  AdamW opt({{"w", w}, {"conv", conv}, {"norm.weight", norm}}, o);
  constexpr int kSteps = 3;
  for (int step = 0; step < kSteps; ++step) {
    for (torch::Tensor* p : {&w, &conv, &norm}) p->mutable_grad() = torch::zeros_like(*p);
    opt.Step(o.lr);
  }
  const double shrink = std::pow(1 - o.lr * o.weight_decay, kSteps);
  EXPECT_LT((w - w0 * shrink).abs().max().item<double>(), 1e-6);
  EXPECT_GT((w - w0).abs().max().item<double>(), 1e-4) << "the matrix decayed";
  EXPECT_LT((conv - conv0 * shrink).abs().max().item<double>(), 1e-6);
  EXPECT_TRUE(torch::equal(norm, norm0)) << "a 1-D parameter must not decay";

  torch::Tensor ref = norm.detach().clone().requires_grad_(true);
  torch::optim::AdamW torch_ref({ref}, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(0));
  AdamW ours({{"norm.weight", norm}}, o);  // weight_decay 0.1, but 1-D
  for (int step = 0; step < 4; ++step) {
    torch::Tensor g = torch::randn({6});
    norm.mutable_grad() = g.clone();
    ref.mutable_grad() = g.clone();
    ours.Step(o.lr);
    torch_ref.step();
  }
  EXPECT_LT((norm - ref).abs().max().item<double>(), 1e-6);
  EXPECT_GT((norm - norm0).abs().max().item<double>(), 1e-3) << "the parameter trained";
}

// bf16 params keep an fp32 master that evolves exactly as an fp32 run would; the params are
// the rounded master. Updates smaller than bf16's resolution still accumulate in the master.
TEST(AdamWTest, Bf16ParamsHaveFp32MasterWeights) {
  torch::manual_seed(1);
  torch::Tensor w32 = torch::randn({16, 8}).requires_grad_(true);
  torch::Tensor w16 = w32.detach().to(torch::kBFloat16).requires_grad_(true);
  {
    torch::NoGradGuard ng;
    w32.copy_(w16.to(torch::kFloat32));
  }
  AdamWOptions o;
  o.lr = 1e-5;  // far below bf16 resolution near 1.0
  AdamW f32({{"w", w32}}, o), b16({{"w", w16}}, o);
  for (int step = 0; step < 20; ++step) {
    torch::Tensor g = torch::randn({16, 8});
    w32.mutable_grad() = g.clone();
    w16.mutable_grad() = g.to(torch::kBFloat16).to(torch::kFloat32).to(torch::kBFloat16);
    // Same gradient values for both (bf16-representable).
    w32.mutable_grad() = w16.grad().to(torch::kFloat32);
    f32.Step(o.lr);
    b16.Step(o.lr);
  }
  torch::Tensor master;
  for (auto& [name, t] : b16.StateTensors())
    if (name == "master.w") master = t;
  ASSERT_TRUE(master.defined());
  EXPECT_EQ(master.scalar_type(), torch::kFloat32);
  EXPECT_LT((master - w32).abs().max().item<double>(), 1e-6);
  EXPECT_TRUE(torch::equal(w16, master.to(torch::kBFloat16)));
  // fp32 params have no separate master copy.
  for (auto& [name, t] : f32.StateTensors()) EXPECT_NE(name, "master.w");
}

TEST(AdamWTest, StateRoundTripResumesExactly) {
  torch::manual_seed(2);
  torch::Tensor a = torch::randn({4, 4}).to(torch::kBFloat16).requires_grad_(true);
  torch::Tensor b = a.detach().clone().requires_grad_(true);
  AdamWOptions o;
  AdamW first({{"p", a}}, o);
  std::vector<torch::Tensor> grads;
  for (int i = 0; i < 4; ++i) grads.push_back(torch::randn({4, 4}).to(torch::kBFloat16));
  for (int i = 0; i < 2; ++i) {
    a.mutable_grad() = grads[i].clone();
    first.Step(1e-2);
  }
  AdamW second({{"p", b}}, o);
  ASSERT_TRUE(second.LoadStateTensors(first.StateTensors()).ok());
  EXPECT_EQ(second.steps(), 2);
  for (int i = 2; i < 4; ++i) {
    a.mutable_grad() = grads[i].clone();
    b.mutable_grad() = grads[i].clone();
    first.Step(1e-2);
    second.Step(1e-2);
  }
  EXPECT_TRUE(torch::equal(a, b));
  AdamW third({{"other", b}}, o);
  absl::Status s = third.LoadStateTensors(first.StateTensors());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("exp_avg.other"), std::string::npos) << s;
}

// Master weights and moments kept in host memory give the same updates and state as on the
// device (on a GPU the host side is pinned and streamed; the arithmetic is the same).
TEST(AdamWTest, StatesOnHostMatchStatesOnDevice) {
  torch::manual_seed(3);
  torch::Tensor a = torch::randn({6, 5}).to(torch::kBFloat16).requires_grad_(true);
  torch::Tensor b = a.detach().clone().requires_grad_(true);
  torch::Tensor c = torch::randn({5}).requires_grad_(true);  // fp32: its own master on the device
  torch::Tensor d = c.detach().clone().requires_grad_(true);
  AdamWOptions o;
  AdamW dev({{"w", a}, {"n", c}}, o);
  AdamW host({{"w", b}, {"n", d}}, o, /*states_on_host=*/true);
  for (int i = 0; i < 5; ++i) {
    torch::Tensor g = torch::randn({6, 5}).to(torch::kBFloat16), h = torch::randn({5});
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    c.mutable_grad() = h.clone();
    d.mutable_grad() = h.clone();
    dev.Step(1e-2);
    host.Step(1e-2);
  }
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_TRUE(torch::equal(c, d));
  auto sd = dev.StateTensors(), sh = host.StateTensors();
  ASSERT_EQ(sd.size(), sh.size());
  for (size_t i = 0; i < sd.size(); ++i) {
    EXPECT_EQ(sd[i].first, sh[i].first);
    EXPECT_TRUE(torch::equal(sd[i].second, sh[i].second)) << sd[i].first;
  }
  // Resuming a host-state optimizer from its own state continues identically.
  torch::Tensor e = b.detach().clone().requires_grad_(true), f = d.detach().clone().requires_grad_(true);
  AdamW resumed({{"w", e}, {"n", f}}, o);
  ASSERT_TRUE(resumed.LoadStateTensors(sh).ok());
  torch::Tensor g = torch::randn({6, 5}).to(torch::kBFloat16);
  b.mutable_grad() = g.clone();
  e.mutable_grad() = g.clone();
  host.Step(1e-2);
  resumed.Step(1e-2);
  EXPECT_TRUE(torch::equal(b, e));
}

TEST(ScheduleTest, WarmupThenCosineToMinimum) {
  ScheduleOptions s;
  s.warmup_steps = 10;
  s.total_steps = 110;
  s.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(ScheduledLr(1.0, 0, s), 0.1);
  EXPECT_DOUBLE_EQ(ScheduledLr(1.0, 9, s), 1.0);
  EXPECT_DOUBLE_EQ(ScheduledLr(1.0, 10, s), 1.0);
  EXPECT_NEAR(ScheduledLr(1.0, 60, s), 0.55, 1e-12);
  EXPECT_NEAR(ScheduledLr(1.0, 110, s), 0.1, 1e-12);
  EXPECT_NEAR(ScheduledLr(1.0, 500, s), 0.1, 1e-12);
  ScheduleOptions bad;
  bad.min_lr_ratio = 2;
  EXPECT_NE(bad.Validate().message().find("schedule.min_lr_ratio (2) must be in [0, 1]"), std::string::npos);
  AdamWOptions o;
  o.lr = -1;
  EXPECT_NE(o.Validate().message().find("optimizer.lr (-1) must be > 0"), std::string::npos);
}

TEST(ClipTest, ClipsToMaxNormAndReportsTheNormBefore) {
  torch::Tensor a = torch::zeros({3}, torch::requires_grad());
  torch::Tensor b = torch::zeros({4}, torch::requires_grad());
  a.mutable_grad() = torch::full({3}, 3.0);
  b.mutable_grad() = torch::full({4}, 4.0);
  const double before = std::sqrt(3 * 9.0 + 4 * 16.0);
  EXPECT_NEAR(ClipGradNorm({a, b}, 1.0), before, 1e-5);
  const double after = std::sqrt(a.grad().pow(2).sum().item<double>() + b.grad().pow(2).sum().item<double>());
  EXPECT_NEAR(after, 1.0, 1e-5);
  EXPECT_NEAR(ClipGradNorm({a, b}, 0.0), after, 1e-5);  // 0 disables
}

}  // namespace
}  // namespace odyssey::engine
