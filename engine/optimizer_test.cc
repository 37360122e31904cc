#include "engine/optimizer.h"

#include <cmath>
#include <map>
#include <random>
#include <tuple>

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

// Master weights and moments kept in host memory (the CPU kernel of engine/host_adamw.h) give
// the same updates and state as on the device, to within ATen's own FMA in its vectorized lerp
// (see HostKernelFollowsTheDeviceMath); a resumed host optimizer continues identically.
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
  EXPECT_LE((a.to(torch::kFloat32) - b.to(torch::kFloat32)).abs().max().item<double>(), 1e-2);
  EXPECT_LT((c - d).abs().max().item<double>(), 1e-6);
  auto sd = dev.StateTensors(), sh = host.StateTensors();
  ASSERT_EQ(sd.size(), sh.size());
  for (size_t i = 0; i < sd.size(); ++i) {
    EXPECT_EQ(sd[i].first, sh[i].first);
    EXPECT_TRUE(torch::allclose(sd[i].second.to(torch::kFloat64), sh[i].second.to(torch::kFloat64), 1e-5, 1e-7))
        << sd[i].first;
  }
  // Resuming a host-state optimizer from its own state continues identically.
  torch::Tensor e = b.detach().clone().requires_grad_(true), f = d.detach().clone().requires_grad_(true);
  AdamW resumed({{"w", e}, {"n", f}}, o, /*states_on_host=*/true);
  ASSERT_TRUE(resumed.LoadStateTensors(sh).ok());
  torch::Tensor g = torch::randn({6, 5}).to(torch::kBFloat16);
  b.mutable_grad() = g.clone();
  e.mutable_grad() = g.clone();
  host.Step(1e-2);
  resumed.Step(1e-2);
  EXPECT_TRUE(torch::equal(b, e));
}

struct KernelCase {
  std::vector<int64_t> shape;
  torch::Dtype dtype;
};

// torch.optim.AdamW's math in float64 (the yardstick both fp32 paths are measured against).
struct Float64AdamW {
  torch::Tensor p, m, v;  // float64, the param's shape
  bool decay = false;
  void Step(const torch::Tensor& g, const AdamWOptions& o, int64_t step) {
    const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(step));
    const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(step));
    if (decay) p = p * (1 - o.lr * o.weight_decay);
    m = o.beta1 * m + (1 - o.beta1) * g;
    v = o.beta2 * v + (1 - o.beta2) * g * g;
    p = p - (o.lr / bc1) * m / (v.sqrt() / std::sqrt(bc2) + o.eps);
  }
};

// The host kernel against the device path (torch ops, engine/optimizer.cc) over several steps:
// shapes of awkward sizes, 1-D (no decay) and 2+-D params, fp32 and bf16, weight decay on and
// off, beta1 on both sides of ATen's lerp switch, and a clip factor on some steps. Against a
// float64 run of the same math, the kernel's error is at most the device path's plus one ulp
// (the only difference allowed is ATen's FMA in its vectorized lerp), the two fp32 results are
// a few ulps apart at most, and a bf16 parameter is exactly its master rounded.
TEST(AdamWTest, HostKernelFollowsTheDeviceMath) {
  const std::vector<KernelCase> cases = {{{1}, torch::kFloat32},        {{97}, torch::kFloat32},
                                         {{257, 3}, torch::kFloat32},   {{2, 3, 5}, torch::kFloat32},
                                         {{1025}, torch::kBFloat16},    {{33, 65}, torch::kBFloat16},
                                         {{7}, torch::kBFloat16},       {{0, 4}, torch::kFloat32}};
  // Clip factors: 0.25 is exact in bf16, 0.37 is not, and the device path rounds a bf16
  // gradient it scales to bf16 (the host kernel scales in fp32, as the float64 yardstick does).
  for (const auto& [wd, beta1, clip] : std::vector<std::tuple<double, double, double>>{
           {0.0, 0.9, 0.25}, {0.1, 0.9, 0.25}, {0.1, 0.3, 0.25}, {0.0, 0.3, 0.37}, {0.1, 0.9, 0.37}}) {
    {
      SCOPED_TRACE(testing::Message() << "weight_decay " << wd << " beta1 " << beta1 << " clip " << clip);
      torch::manual_seed(7);
      AdamWOptions o;
      o.lr = 3e-2;
      o.beta1 = beta1;
      o.weight_decay = wd;
      std::vector<std::pair<std::string, torch::Tensor>> dev_params, host_params;
      std::vector<Float64AdamW> ref;
      for (size_t i = 0; i < cases.size(); ++i) {
        torch::Tensor p = torch::randn(cases[i].shape).to(cases[i].dtype);
        dev_params.emplace_back("p" + std::to_string(i), p.clone().requires_grad_(true));
        host_params.emplace_back("p" + std::to_string(i), p.clone().requires_grad_(true));
        const torch::Tensor p64 = p.to(torch::kFloat64);
        ref.push_back({p64, torch::zeros_like(p64), torch::zeros_like(p64), p.dim() >= 2 && wd > 0});
      }
      AdamW dev(dev_params, o);
      HostOptimizerOptions threads;
      threads.threads = 3;
      threads.chunk_elements = 64;  // several chunks per parameter, taken by several threads
      AdamW host(host_params, o, /*states_on_host=*/true, threads);
      for (int64_t step = 1; step <= 5; ++step) {
        const double scale = step % 2 == 0 ? clip : 1.0;  // a clip on some steps
        for (size_t i = 0; i < cases.size(); ++i) {
          torch::Tensor g = torch::randn(cases[i].shape).to(cases[i].dtype);
          dev_params[i].second.mutable_grad() = g.clone();
          host_params[i].second.mutable_grad() = g.clone();
          // The float64 run sees the fp32 runs' scaled gradient.
          ref[i].Step((g.to(torch::kFloat32) * static_cast<float>(scale)).to(torch::kFloat64), o, step);
        }
        dev.Step(o.lr, scale);
        host.Step(o.lr, scale);
      }
      auto state = [](const AdamW& a) {
        std::map<std::string, torch::Tensor> m;
        for (auto& [name, t] : a.StateTensors()) m[name] = t;
        return m;
      };
      const auto sd = state(dev), sh = state(host);
      for (size_t i = 0; i < cases.size(); ++i) {
        const std::string name = "p" + std::to_string(i);
        SCOPED_TRACE(name);
        const bool bf16 = cases[i].dtype == torch::kBFloat16;
        if (dev_params[i].second.numel() == 0) continue;  // ran without touching anything
        // The fp32 values: the master of a bf16 param, the param itself otherwise.
        const torch::Tensor d = bf16 ? sd.at("master." + name) : dev_params[i].second.detach();
        const torch::Tensor h = bf16 ? sh.at("master." + name) : host_params[i].second.detach();
        const std::vector<std::tuple<std::string, torch::Tensor, torch::Tensor, torch::Tensor>> compared = {
            {"master", d, h, ref[i].p},
            {"exp_avg", sd.at("exp_avg." + name), sh.at("exp_avg." + name), ref[i].m},
            {"exp_avg_sq", sd.at("exp_avg_sq." + name), sh.at("exp_avg_sq." + name), ref[i].v}};
        for (const auto& [what, dd, hh, rr] : compared) {
          const double err_dev = (dd.to(torch::kFloat64) - rr).abs().max().item<double>();
          const double err_host = (hh.to(torch::kFloat64) - rr).abs().max().item<double>();
          const double ulp = rr.abs().max().item<double>() * std::ldexp(1.0, -23);
          EXPECT_LE(err_host, err_dev + ulp) << what << ": the host kernel is less accurate than the device path";
          const double apart = (dd.to(torch::kFloat64) - hh.to(torch::kFloat64)).abs().max().item<double>();
          if (!bf16 || clip == 0.25) {
            EXPECT_LE(apart, 4 * ulp) << what << ": fp32 host vs device";
          }
        }
        if (bf16) {
          EXPECT_TRUE(torch::equal(host_params[i].second, h.to(torch::kBFloat16)))
              << "a bf16 parameter is its master rounded";
        }
      }
    }
  }
}

// The same update with one thread and whole parameters, or several threads and small chunks:
// bitwise the same (the kernel is elementwise; chunks only split the work).
TEST(AdamWTest, HostUpdateDoesNotDependOnThreadsOrChunks) {
  torch::manual_seed(8);
  torch::Tensor a0 = torch::randn({300, 7}).to(torch::kBFloat16), b0 = torch::randn({1001});
  HostOptimizerOptions one, many;
  one.threads = 1;
  one.chunk_elements = int64_t{1} << 20;
  many.threads = 4;
  many.chunk_elements = 37;
  torch::Tensor a1 = a0.clone().requires_grad_(true), b1 = b0.clone().requires_grad_(true);
  torch::Tensor a2 = a0.clone().requires_grad_(true), b2 = b0.clone().requires_grad_(true);
  AdamWOptions o;
  AdamW x({{"a", a1}, {"b", b1}}, o, true, one), y({{"a", a2}, {"b", b2}}, o, true, many);
  EXPECT_EQ(y.states_on_host(), true);
  for (int step = 0; step < 3; ++step) {
    torch::Tensor ga = torch::randn({300, 7}).to(torch::kBFloat16), gb = torch::randn({1001});
    a1.mutable_grad() = ga.clone();
    a2.mutable_grad() = ga.clone();
    b1.mutable_grad() = gb.clone();
    b2.mutable_grad() = gb.clone();
    x.Step(1e-2, 0.5);
    y.Step(1e-2, 0.5);
  }
  EXPECT_TRUE(torch::equal(a1, a2));
  EXPECT_TRUE(torch::equal(b1, b2));
  auto sx = x.StateTensors(), sy = y.StateTensors();
  for (size_t i = 0; i < sx.size(); ++i) EXPECT_TRUE(torch::equal(sx[i].second, sy[i].second)) << sx[i].first;
}

// The CUDA pipeline's form of the kernel: the rounded parameter written over the bf16 gradient
// it was computed from (one staging buffer each way) equals the form with a separate output.
TEST(AdamWTest, HostKernelInPlaceOutputEqualsSeparateOutput) {
  torch::manual_seed(10);
  const int64_t n = 1029;
  AdamWStep step;
  step.lr = 1e-2;
  step.weight_decay = 0.1;
  step.step = 3;
  step.grad_scale = 0.6;
  const AdamWConstants k = AdamWConstants::For(step, /*decay=*/true);
  torch::Tensor grad = torch::randn({n}).to(torch::kBFloat16);  // (n,)
  torch::Tensor master = torch::randn({n}), m = torch::randn({n}) * 0.1, v = torch::rand({n}) * 0.1;  // (n,) each
  torch::Tensor master2 = master.clone(), m2 = m.clone(), v2 = v.clone(), inplace = grad.clone();
  torch::Tensor out = torch::empty({n}, torch::kBFloat16);
  auto bits = [](torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  HostAdamWUpdate(k, n, grad.data_ptr(), true, master.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                  bits(out));
  HostAdamWUpdate(k, n, inplace.data_ptr(), true, master2.data_ptr<float>(), m2.data_ptr<float>(),
                  v2.data_ptr<float>(), bits(inplace));
  EXPECT_TRUE(torch::equal(out, inplace));
  EXPECT_TRUE(torch::equal(master, master2));
  EXPECT_TRUE(torch::equal(out, master.to(torch::kBFloat16)));
  EXPECT_FALSE(torch::equal(out, grad));
}

// bf16 moments (HostOptimizerOptions::bf16_moments) against fp32 moments from the same inputs,
// for both of ATen's lerp forms, with weight decay, a clip factor, a bf16 and an fp32 parameter,
// several chunks and threads. Step 1 from zero moments: the stored moments (State views, in
// bf16) are the fp32 mode's rounded to nearest even, and the masters and params are
// bit-identical, because the step's update reads its moments in fp32 before the rounding.
// Step 2 reads the rounded moments: it equals, bit for bit, the fp32 mode run on from its state
// with the moments rounded (each moment is computed in fp32 from the stored one widened), and
// differs from the fp32 mode left alone (the rounding is not a no-op).
TEST(HostAdamWTest, Bf16MomentsAreTheFp32MomentsRounded) {
  for (const double beta1 : {0.9, 0.3}) {
    SCOPED_TRACE(testing::Message() << "beta1 " << beta1);
    torch::manual_seed(21);
    const torch::Tensor w0 = torch::randn({33, 65}).to(torch::kBFloat16), n0 = torch::randn({97});
    // f: fp32 moments, rounded after step 1; g: fp32 moments left alone; b: bf16 moments.
    std::vector<torch::Tensor> pf = {w0.clone(), n0.clone()}, pg = {w0.clone(), n0.clone()},
                               pb = {w0.clone(), n0.clone()};
    HostOptimizerOptions fp32, bf16;
    fp32.threads = bf16.threads = 2;
    fp32.chunk_elements = bf16.chunk_elements = 100;  // several chunks per parameter
    bf16.bf16_moments = true;
    HostAdamW f(pf, fp32), g(pg, fp32), b(pb, bf16);
    const std::vector<HostAdamW*> all = {&f, &g, &b};
    AdamWStep step;
    step.lr = 1e-2;
    step.beta1 = beta1;
    step.weight_decay = 0.1;
    step.grad_scale = 0.37;
    for (step.step = 1; step.step <= 2; ++step.step) {
      SCOPED_TRACE(testing::Message() << "step " << step.step);
      const torch::Tensor gw = torch::randn({33, 65}).to(torch::kBFloat16), gn = torch::randn({97});
      for (auto* params : {&pf, &pg, &pb}) {
        (*params)[0].mutable_grad() = gw.clone();
        (*params)[1].mutable_grad() = gn.clone();
      }
      for (HostAdamW* o : all) o->Step(step);
      for (size_t i = 0; i < 2; ++i) {
        SCOPED_TRACE(testing::Message() << "param " << i);
        const HostAdamW::State sf = f.state(i), sg = g.state(i), sb = b.state(i);
        EXPECT_EQ(sb.master.scalar_type(), torch::kFloat32);
        EXPECT_EQ(sb.exp_avg.scalar_type(), torch::kBFloat16);
        EXPECT_EQ(sb.exp_avg_sq.scalar_type(), torch::kBFloat16);
        EXPECT_EQ(sb.exp_avg.sizes(), pb[i].sizes());
        EXPECT_TRUE(torch::equal(sb.exp_avg, sf.exp_avg.to(torch::kBFloat16)));
        EXPECT_TRUE(torch::equal(sb.exp_avg_sq, sf.exp_avg_sq.to(torch::kBFloat16)));
        EXPECT_TRUE(torch::equal(sb.master, sf.master));
        EXPECT_TRUE(torch::equal(pb[i], pf[i]));
        if (step.step == 1) {
          EXPECT_FALSE(torch::equal(sf.exp_avg, sb.exp_avg.to(torch::kFloat32))) << "the rounding is exercised";
          // f goes on from the state b stores (a write through State is a write of the state).
          sf.exp_avg.copy_(sf.exp_avg.to(torch::kBFloat16));
          sf.exp_avg_sq.copy_(sf.exp_avg_sq.to(torch::kBFloat16));
        } else {
          EXPECT_FALSE(torch::equal(sb.master, sg.master)) << "step 2 reads the rounded moments";
        }
      }
    }
  }
}

// Host bytes of the states: 12 per parameter with fp32 moments (master 4, exp_avg 4,
// exp_avg_sq 4), 8 with bf16 moments (4 + 2 + 2); an fp32 CPU parameter is its own master.
TEST(HostAdamWTest, Bf16MomentsTakeEightBytesAParameter) {
  const torch::Tensor w = torch::randn({33, 65}).to(torch::kBFloat16), n = torch::randn({97}).to(torch::kBFloat16);
  const int64_t N = w.numel() + n.numel();
  HostOptimizerOptions fp32, bf16;
  bf16.bf16_moments = true;
  EXPECT_EQ(HostAdamW({w.clone(), n.clone()}, fp32).state_bytes(), 12 * N);
  EXPECT_EQ(HostAdamW({w.clone(), n.clone()}, bf16).state_bytes(), 8 * N);
  const torch::Tensor own_master = torch::randn({97});  // fp32 on the CPU: moments only
  EXPECT_EQ(HostAdamW({own_master.clone()}, fp32).state_bytes(), 8 * 97);
  EXPECT_EQ(HostAdamW({own_master.clone()}, bf16).state_bytes(), 4 * 97);
}

// Least squares, min |X W^T + b - Y|^2 over a bf16 W (and an fp32 bias b), 50 steps of AdamW
// with the state on the host, fp32 vs bf16 moments, each run on its own gradients. Both losses
// fall about 100x, and the runs agree: measured over seeds 1..7 and 22, the final fp32 masters of
// W differ by 1.4e-3 to 1.7e-3 relative (Frobenius; bf16's own relative step is 3.9e-3) and the
// final losses by at most 0.7%; the bars are about 3x those (5e-3, 2%).
TEST(HostAdamWTest, Bf16MomentsTrackFp32MomentsOnLeastSquares) {
  torch::manual_seed(22);
  const torch::Tensor X = torch::randn({128, 24});                 // (N, in)
  const torch::Tensor W_true = torch::randn({16, 24}), b_true = torch::randn({16});
  const torch::Tensor Y = torch::matmul(X, W_true.t()) + b_true;  // (N, out)
  const torch::Tensor w0 = (torch::randn({16, 24}) * 0.1).to(torch::kBFloat16), b0 = torch::zeros({16});
  AdamWOptions o;
  o.lr = 5e-2;
  o.weight_decay = 0;
  auto loss_of = [&](const torch::Tensor& w, const torch::Tensor& b) {
    return (torch::matmul(X, w.to(torch::kFloat32).t()) + b - Y).square().mean();  // ()
  };
  std::vector<torch::Tensor> masters;  // (16, 24) fp32 each
  std::vector<double> first_loss, last_loss;
  for (const bool bf16_moments : {false, true}) {
    SCOPED_TRACE(testing::Message() << "bf16_moments " << bf16_moments);
    torch::Tensor w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    HostOptimizerOptions host;
    host.bf16_moments = bf16_moments;
    AdamW opt({{"w", w}, {"b", b}}, o, /*states_on_host=*/true, host);
    for (int step = 0; step < 50; ++step) {
      opt.ZeroGrad();
      torch::Tensor loss = loss_of(w, b);
      loss.backward();
      if (step == 0) first_loss.push_back(loss.item<double>());
      opt.Step(o.lr);
    }
    last_loss.push_back(loss_of(w, b).item<double>());
    EXPECT_LT(last_loss.back(), first_loss.back() / 50) << "the loss falls";
    for (auto& [name, t] : opt.StateTensors())
      if (name == "master.w") masters.push_back(t.clone());
  }
  ASSERT_EQ(masters.size(), 2u);
  const double rel = (masters[1] - masters[0]).norm().item<double>() / masters[0].norm().item<double>();
  EXPECT_LT(rel, 5e-3) << "bf16 moments strayed from fp32 moments";
  EXPECT_GT(rel, 0) << "the runs are different runs";
  EXPECT_LT(std::abs(last_loss[1] - last_loss[0]), 0.02 * last_loss[0]);
}

// Checkpoints hold fp32 moments whatever the setting, so either setting loads either's. fp32
// moments loaded into bf16 ones come back rounded to nearest even (the only change: names,
// dtypes, masters and step as written); bf16 moments saved and loaded into fp32 ones come back
// exactly, and the two optimizers then step as one: the same masters and params, the bf16
// moments the fp32 ones rounded.
TEST(HostAdamWTest, CheckpointsCrossBf16AndFp32Moments) {
  torch::manual_seed(23);
  const torch::Tensor w0 = torch::randn({9, 13}).to(torch::kBFloat16), n0 = torch::randn({13});
  AdamWOptions o;
  o.weight_decay = 0.1;
  HostOptimizerOptions fp32, bf16;
  bf16.bf16_moments = true;
  auto by_name = [](const AdamW& a) {
    std::map<std::string, torch::Tensor> m;
    for (auto& [name, t] : a.StateTensors()) m[name] = t.clone();
    return m;
  };
  auto step = [](AdamW& a, torch::Tensor& w, torch::Tensor& n, int64_t seed) {
    torch::manual_seed(seed);
    w.mutable_grad() = torch::randn({9, 13}).to(torch::kBFloat16);
    n.mutable_grad() = torch::randn({13});
    a.Step(1e-2);
  };
  torch::Tensor wa = w0.clone().requires_grad_(true), na = n0.clone().requires_grad_(true);
  AdamW a({{"w", wa}, {"n", na}}, o, /*states_on_host=*/true, fp32);
  for (int64_t i = 0; i < 3; ++i) step(a, wa, na, 100 + i);
  const auto sa = by_name(a);

  // fp32 -> bf16 moments.
  torch::Tensor wb = wa.detach().clone().requires_grad_(true), nb = na.detach().clone().requires_grad_(true);
  AdamW b({{"w", wb}, {"n", nb}}, o, /*states_on_host=*/true, bf16);
  ASSERT_TRUE(b.LoadStateTensors(a.StateTensors()).ok());
  const auto sb = by_name(b);
  ASSERT_EQ(sb.size(), sa.size());
  for (const auto& [name, t] : sa) {
    SCOPED_TRACE(name);
    ASSERT_EQ(sb.count(name), 1u);
    const torch::Tensor& got = sb.at(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << "a checkpoint's format does not depend on the setting";
    if (name.rfind("exp_avg", 0) == 0) {
      EXPECT_TRUE(torch::equal(got, t.to(torch::kBFloat16).to(torch::kFloat32)));
      EXPECT_FALSE(torch::equal(got, t)) << "the rounding is exercised";
    } else {
      EXPECT_TRUE(torch::equal(got, t));
    }
  }

  // bf16 -> fp32 moments: exact, and the two step alike.
  step(b, wb, nb, 200);
  const auto sb2 = by_name(b);
  torch::Tensor wc = wb.detach().clone().requires_grad_(true), nc = nb.detach().clone().requires_grad_(true);
  AdamW c({{"w", wc}, {"n", nc}}, o, /*states_on_host=*/true, fp32);
  ASSERT_TRUE(c.LoadStateTensors(b.StateTensors()).ok());
  for (const auto& [name, t] : by_name(c)) EXPECT_TRUE(torch::equal(t, sb2.at(name))) << name;
  EXPECT_EQ(c.steps(), 4);
  step(b, wb, nb, 300);
  step(c, wc, nc, 300);
  EXPECT_TRUE(torch::equal(wb, wc));
  EXPECT_TRUE(torch::equal(nb, nc));
  const auto sb3 = by_name(b), sc3 = by_name(c);
  for (const auto& [name, t] : sc3) {
    const bool moment = name.rfind("exp_avg", 0) == 0;
    EXPECT_TRUE(torch::equal(sb3.at(name), moment ? t.to(torch::kBFloat16).to(torch::kFloat32) : t)) << name;
  }
}

// bf16 moments are the host kernel's: the device path refuses them, naming the setting to change.
TEST(AdamWTest, DeviceStateRefusesBf16Moments) {
  torch::Tensor w = torch::randn({4, 4}).requires_grad_(true);
  HostOptimizerOptions bf16;
  bf16.bf16_moments = true;
  try {
    AdamW opt({{"w", w}}, AdamWOptions(), /*states_on_host=*/false, bf16);
    ADD_FAILURE() << "bf16 moments accepted on the device";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16 moments need the optimizer state on the host "
                                         "(memory.optimizer_on_host)"),
              std::string::npos)
        << e.what();
  }
  AdamW host({{"w", w}}, AdamWOptions(), /*states_on_host=*/true, bf16);  // the host takes them
  EXPECT_TRUE(host.states_on_host());
}

// The rounding helper is c10::BFloat16's: ties to even, NaN to 0x7FC0, infinities, the largest
// floats (which round to infinity), denormals, and a million random bit patterns.
TEST(Bf16Test, RoundingEqualsC10BFloat16) {
  std::vector<uint32_t> bits = {0x00000000, 0x80000000, 0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,
                                0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                                0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x00000001, 0x00008000, 0x00018000, 0x00007FFF,
                                0x007FFFFF, 0x80008000, 0x00800000, 0x00FF8000, 0xC0490FDB};
  std::mt19937 rng(1);
  for (int i = 0; i < 1000000; ++i) bits.push_back(rng());
  for (uint32_t b : bits) {
    const float f = __builtin_bit_cast(float, b);
    const c10::BFloat16 ref(f);
    ASSERT_EQ(Bf16Bits(f), ref.x) << std::hex << "0x" << b;
    const float back = Bf16Value(ref.x);
    const float ref_back = static_cast<float>(ref);
    ASSERT_EQ(__builtin_bit_cast(uint32_t, back), __builtin_bit_cast(uint32_t, ref_back)) << std::hex << "0x" << b;
  }
  // And the tensor conversion the device path uses (copy_ into a bf16 param) for finite values.
  torch::Tensor x = torch::randn({4097}) * 1e3;
  torch::Tensor y = x.to(torch::kBFloat16);
  for (int64_t i = 0; i < x.numel(); ++i) {
    ASSERT_EQ(Bf16Bits(x.data_ptr<float>()[i]), y.data_ptr<c10::BFloat16>()[i].x) << i;
  }
}

// deferred_cpu behaves as the CUDA pipeline at its laziest: a parameter changes only when it is
// waited for, a gradient sent by GradsReady is the one used even if .grad() changes afterwards,
// StateTensors waits for the update in flight, and ZeroGrad forgets what was sent.
TEST(AdamWTest, DeferredHostUpdateRunsWhenWaitedFor) {
  torch::manual_seed(9);
  const torch::Tensor w0 = torch::randn({5, 4}), n0 = torch::randn({4});
  const torch::Tensor gw = torch::randn({5, 4}), gn = torch::randn({4});
  AdamWOptions o;
  torch::Tensor w1 = w0.clone().requires_grad_(true), n1 = n0.clone().requires_grad_(true);
  AdamW sync({{"w", w1}, {"n", n1}}, o, true);
  w1.mutable_grad() = gw.clone();
  n1.mutable_grad() = gn.clone();
  sync.Step(1e-2);

  HostOptimizerOptions lazy;
  lazy.deferred_cpu = true;
  torch::Tensor w2 = w0.clone().requires_grad_(true), n2 = n0.clone().requires_grad_(true);
  AdamW deferred({{"w", w2}, {"n", n2}}, o, true, lazy);
  w2.mutable_grad() = gw.clone();
  deferred.GradsReady({0});
  w2.mutable_grad().mul_(100);  // too late: the sent gradient counts
  n2.mutable_grad() = gn.clone();
  deferred.Step(1e-2);
  deferred.ZeroGrad();
  EXPECT_TRUE(torch::equal(w2, w0)) << "not waited for yet";
  deferred.WaitParams({0});
  EXPECT_TRUE(torch::equal(w2, w1));
  EXPECT_TRUE(torch::equal(n2, n0)) << "still not waited for";
  auto state = deferred.StateTensors();  // waits for the rest
  EXPECT_TRUE(torch::equal(n2, n1));
  // A gradient sent and then dropped (a failed step) is not used by the next step.
  w2.mutable_grad() = torch::full({5, 4}, 1e3);
  deferred.GradsReady({0});
  deferred.ZeroGrad();
  w1.mutable_grad() = gw.clone();
  w2.mutable_grad() = gw.clone();
  sync.Step(1e-2);
  deferred.Step(1e-2);
  deferred.Finish();
  EXPECT_TRUE(torch::equal(w2, w1));
}

// Released gradients (deferred_cpu, as the CUDA pipeline): after GradsReady, ReleaseGrads drops
// the device's .grad() of the params sent and keeps their squared norms; a param not sent keeps
// its gradient. The clip over what is left plus the released squares is the norm of every
// gradient, and the step from the sent copies equals the synchronous optimizer's, clipped. The
// next step starts with nothing released, and ZeroGrad forgets a release too.
TEST(AdamWTest, ReleasedGradientsStillUpdateAndCountInTheClip) {
  torch::manual_seed(19);
  const torch::Tensor w0 = torch::randn({5, 4}), n0 = torch::randn({4}), b0 = torch::randn({3});
  const torch::Tensor gw = torch::randn({5, 4}) * 3, gn = torch::randn({4}), gb = torch::randn({3});
  AdamWOptions o;
  o.weight_decay = 0.1;
  torch::Tensor w1 = w0.clone().requires_grad_(true), n1 = n0.clone().requires_grad_(true),
                b1 = b0.clone().requires_grad_(true);
  AdamW sync({{"w", w1}, {"n", n1}, {"b", b1}}, o, true);
  HostOptimizerOptions lazy;
  lazy.deferred_cpu = true;
  torch::Tensor w2 = w0.clone().requires_grad_(true), n2 = n0.clone().requires_grad_(true),
                b2 = b0.clone().requires_grad_(true);
  AdamW deferred({{"w", w2}, {"n", n2}, {"b", b2}}, o, true, lazy);
  for (int step = 0; step < 2; ++step) {
    w1.mutable_grad() = gw.clone(), n1.mutable_grad() = gn.clone(), b1.mutable_grad() = gb.clone();
    w2.mutable_grad() = gw.clone(), n2.mutable_grad() = gn.clone(), b2.mutable_grad() = gb.clone();
    EXPECT_FALSE(deferred.ReleasedGradSquares().defined()) << "step " << step;
    deferred.GradsReady({0, 1});
    deferred.ReleaseGrads({0, 1, 2});  // b was not sent: it stays
    EXPECT_FALSE(w2.grad().defined());
    EXPECT_FALSE(n2.grad().defined());
    ASSERT_TRUE(b2.grad().defined());
    const torch::Tensor sq = deferred.ReleasedGradSquares();
    ASSERT_TRUE(sq.defined());
    EXPECT_NEAR(sq.item<double>(), (gw.square().sum() + gn.square().sum()).item<double>(), 1e-4);
    const GradClip want = GradClipScale({w1, n1, b1}, 1.0);
    const GradClip got = GradClipScale({w2, n2, b2}, 1.0, sq);
    EXPECT_NEAR(got.norm.item<double>(), want.norm.item<double>(), 1e-5 * want.norm.item<double>());
    EXPECT_LT(want.scale.item<double>(), 1.0) << "the clip is exercised";
    sync.Step(1e-2, want.scale);
    deferred.Step(1e-2, got.scale);
    sync.ZeroGrad();
    deferred.ZeroGrad();
    deferred.Finish();
    EXPECT_LT((w2 - w1).abs().max().item<double>(), 1e-6) << "step " << step;
    EXPECT_LT((n2 - n1).abs().max().item<double>(), 1e-6) << "step " << step;
    EXPECT_LT((b2 - b1).abs().max().item<double>(), 1e-6) << "step " << step;
    EXPECT_GT((w2 - w0).abs().max().item<double>(), 1e-4) << "the released params moved";
  }
  // A release dropped with its gradients (a failed step) is not counted by the next.
  w2.mutable_grad() = gw.clone();
  deferred.GradsReady({0});
  deferred.ReleaseGrads({0});
  deferred.ZeroGrad();
  EXPECT_FALSE(deferred.ReleasedGradSquares().defined());
}

// The CUDA pipeline (bf16 params on the GPU): gradients sent early and released from the GPU
// for some params (as the trainer does at the end of a layer group's backward) and at Step for
// the rest, the update on
// host threads in small chunks, and reads of each parameter on the compute stream right after
// WaitParams, before the update has finished elsewhere. After 3 steps (one clipped) the params
// match the device AdamW's to a bf16 ulp (the device path rounds a clipped gradient to bf16,
// the host multiplies in fp32; by 0.25 both are exact), the masters to 3e-5 (CUDA's ops round
// a little differently: a reciprocal for the division, FMAs), and every read after WaitParams saw
// the updated value.
TEST(HostAdamWGpuTest, PipelineMatchesDeviceAdamW) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  const std::vector<std::vector<int64_t>> shapes = {{1}, {97}, {257, 33}, {1025}, {4096, 1024}, {3, 5, 7}};
  torch::manual_seed(11);
  std::vector<std::pair<std::string, torch::Tensor>> dev_params, host_params;
  std::vector<torch::Tensor> initial;  // (shape) fp32
  for (size_t i = 0; i < shapes.size(); ++i) {
    torch::Tensor p = torch::randn(shapes[i], torch::TensorOptions().device(cuda)).to(torch::kBFloat16);
    initial.push_back(p.to(torch::kFloat32));
    dev_params.emplace_back("p" + std::to_string(i), p.clone().requires_grad_(true));
    host_params.emplace_back("p" + std::to_string(i), p.clone().requires_grad_(true));
  }
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  HostOptimizerOptions threads;
  threads.threads = 4;
  threads.chunk_elements = 1 << 14;
  AdamW dev(dev_params, o), host(host_params, o, /*states_on_host=*/true, threads);
  ASSERT_TRUE(host.states_on_host());
  const int64_t P = static_cast<int64_t>(shapes.size());
  std::vector<torch::Tensor> seen(shapes.size());  // (shape) fp32: each param as read after WaitParams
  for (int step = 0; step < 3; ++step) {
    const double scale = step == 1 ? 0.25 : 1.0;
    for (int64_t i = P - 1; i >= 0; --i) {  // backward's order
      torch::Tensor g = torch::randn(shapes[static_cast<size_t>(i)], torch::TensorOptions().device(cuda)).to(torch::kBFloat16);
      dev_params[static_cast<size_t>(i)].second.mutable_grad() = g.clone();
      host_params[static_cast<size_t>(i)].second.mutable_grad() = g;
      if (i % 2 == 1) {  // the rest go at Step
        host.GradsReady({i});
        host.ReleaseGrads({i});  // off the GPU: the update reads the copy
        EXPECT_FALSE(host_params[static_cast<size_t>(i)].second.grad().defined());
      }
    }
    dev.Step(o.lr, scale);
    host.Step(o.lr, scale);
    host.ZeroGrad();  // the copies in flight still land (recordStream keeps their memory)
    dev.ZeroGrad();
    for (int64_t i = 0; i < P; ++i) {  // the next forward's order
      host.WaitParams({i});
      seen[static_cast<size_t>(i)] = host_params[static_cast<size_t>(i)].second.detach().to(torch::kFloat32);
    }
  }
  host.Finish();
  auto sd = dev.StateTensors(), sh = host.StateTensors();
  std::map<std::string, torch::Tensor> dm(sd.begin(), sd.end()), hm(sh.begin(), sh.end());
  for (int64_t i = 0; i < P; ++i) {
    const std::string name = "p" + std::to_string(i);
    SCOPED_TRACE(name);
    const torch::Tensor& hp = host_params[static_cast<size_t>(i)].second;
    const torch::Tensor& dp = dev_params[static_cast<size_t>(i)].second;
    EXPECT_TRUE(torch::equal(seen[static_cast<size_t>(i)], hp.detach().to(torch::kFloat32)))
        << "a read after WaitParams saw the parameter before its update";
    const torch::Tensor master_h = hm.at("master." + name).to(cuda), master_d = dm.at("master." + name);
    EXPECT_TRUE(torch::equal(hp, master_h.to(torch::kBFloat16))) << "the param is its master rounded";
    // bf16 ulp of each element: 2^(exponent - 7).
    const torch::Tensor ulp = torch::pow(2.0, torch::floor(torch::log2(master_d.abs().clamp_min(1e-30))) - 7);
    EXPECT_TRUE(((hp.to(torch::kFloat32) - dp.to(torch::kFloat32)).abs() <= ulp * 1.01).all().item<bool>());
    EXPECT_LT((master_h - master_d).abs().max().item<double>(), 3 * o.lr * 1e-3);
    EXPECT_GT((hp.to(torch::kFloat32) - initial[static_cast<size_t>(i)]).abs().max().item<double>(), 1e-3)
        << "three steps of lr 1e-2 moved the parameter";
  }
  // StateTensors while an update is in flight: it waits, and equals the finished state.
  for (int64_t i = 0; i < P; ++i) {
    host_params[static_cast<size_t>(i)].second.mutable_grad() =
        torch::randn(shapes[static_cast<size_t>(i)], torch::TensorOptions().device(cuda)).to(torch::kBFloat16);
  }
  host.Step(o.lr);
  auto during = host.StateTensors();
  std::vector<torch::Tensor> copies;
  for (auto& [name, t] : during) copies.push_back(t.clone());
  host.Finish();
  auto after = host.StateTensors();
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(torch::equal(copies[i], after[i].second)) << after[i].first;
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
