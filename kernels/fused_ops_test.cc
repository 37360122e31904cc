// The fused ops of kernels/fused_ops.h. On the CPU: the reference paths against autograd of
// the textbook formulas in fp64 and against torch::optim::AdamW, and RoPE's defining property
// (scores depend only on the distance of positions). On CUDA (the *_cuda cases, skipped without
// a GPU or in a CPU build): each kernel against ground truth in fp64 computed from the same
// bf16 inputs, with the bar at twice the error of the bf16 libtorch reference (the same call
// with the kernels switched off) plus eight fp32 ulps at the tensor's scale. Awkward sizes:
// row counts that fill no wave, widths that are not powers of two, element counts that leave a
// vector tail, widths that need several chunks per thread.
#include "kernels/fused_ops.h"

#include <cfloat>
#include <cmath>

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace odyssey::kernels {
namespace {

constexpr double kEps = 1e-5;

double MaxError(const torch::Tensor& a, const torch::Tensor& truth) {
  return (a.detach().to(torch::kCPU, torch::kFloat64) - truth.detach().to(torch::kCPU, torch::kFloat64))
      .abs()
      .max()
      .item<double>();
}
double Scale(const torch::Tensor& truth) { return truth.detach().abs().max().item<double>(); }

// The kernel's error must be at most twice the reference's (both against the truth), plus a few
// fp32 ulps at the tensor's scale for results the reference happens to get exact.
void ExpectWithinBar(const std::string& what, const torch::Tensor& kernel, const torch::Tensor& reference,
                     const torch::Tensor& truth) {
  const double k = MaxError(kernel, truth), r = MaxError(reference, truth);
  const double bar = 2 * r + 8 * FLT_EPSILON * Scale(truth);
  EXPECT_LE(k, bar) << what << ": kernel error " << k << ", reference error " << r;
  EXPECT_TRUE(std::isfinite(k)) << what;
}

// y = w * x / rms(x), no rounding anywhere (the truth).
torch::Tensor NormFormula(const torch::Tensor& x, const torch::Tensor& w) {
  return w * (x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + kEps));
}

TEST(FusedOps, RmsNormReferenceBackwardMatchesAutograd) {
  torch::manual_seed(1);
  const int64_t N = 37, H = 48;
  torch::Tensor x = torch::randn({N, H}, torch::kFloat64), w = torch::rand({H}, torch::kFloat64) + 0.5;
  torch::Tensor g = torch::randn({N, H}, torch::kFloat64);
  torch::Tensor xa = x.clone().requires_grad_(true), wa = w.clone().requires_grad_(true);
  NormFormula(xa, wa).backward(g);
  for (int64_t chunk : {int64_t{3} * H, int64_t{1} << 20}) {  // several chunks, and one
    torch::Tensor rstd;
    torch::Tensor y = RmsNormRows(x, w, kEps, chunk, &rstd);
    // The reference normalizes in fp32 whatever the input's dtype (as transformers does).
    EXPECT_LT(MaxError(y, NormFormula(x, w)), 1e-5) << chunk;
    auto [dx, dw] = RmsNormRowsBackward(g, x, w, rstd, chunk);
    EXPECT_LT(MaxError(dx, xa.grad()), 1e-5) << chunk;
    EXPECT_LT(MaxError(dw, wa.grad()), 1e-4) << chunk;
  }
}

// Tables for positions 0..S-1 as transformers builds them: angles pos * inv_freq, repeated.
std::pair<torch::Tensor, torch::Tensor> Tables(int64_t B, int64_t S, int64_t D, torch::TensorOptions o,
                                               int64_t offset = 0) {
  torch::Tensor inv = 1.0 / torch::pow(10000.0, torch::arange(0, D, 2, torch::kFloat64) / static_cast<double>(D));
  torch::Tensor pos = torch::arange(offset, offset + S, torch::kFloat64).unsqueeze(-1);  // (S, 1)
  torch::Tensor emb = torch::cat({pos * inv, pos * inv}, -1).unsqueeze(0).expand({B, S, D}).contiguous();
  return {emb.cos().to(o), emb.sin().to(o)};
}

// The short convolution + SiLU written out: pre[t] = sum_j w[j] x[ctx + t - (Kw - 1) + j] (rows
// before 0 zeros), y = pre * sigmoid(pre), for the rows after the context.
torch::Tensor ShortConvSiluFormula(const torch::Tensor& x, const torch::Tensor& w, int64_t ctx) {
  const int64_t S = x.size(1), Kw = w.size(2), n = S - ctx;
  torch::Tensor pre = torch::zeros({x.size(0), n, x.size(2)}, x.options());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < Kw; ++j) {
      const int64_t s = ctx + t - (Kw - 1) + j;
      if (s >= 0) pre.select(1, t).add_(x.select(1, s) * w.select(2, j).squeeze(1));
    }
  }
  return pre * torch::sigmoid(pre);
}

// The reference path (pad, depthwise conv1d, silu) is the formula, context rows and the zeros before the
// sequence included, and its gradients are the formula's.
TEST(FusedOps, ShortConvSiluReferenceIsTheFormula) {
  torch::manual_seed(9);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  for (int64_t ctx : {0, 3}) {
    torch::Tensor x = torch::randn({2, 37, 6}, f64).requires_grad_(true), w = torch::randn({6, 1, 4}, f64);
    w.requires_grad_(true);
    torch::Tensor xr = x.detach().clone().requires_grad_(true), wr = w.detach().clone().requires_grad_(true);
    torch::Tensor y = ShortConvSilu(x, w, ctx), want = ShortConvSiluFormula(xr, wr, ctx);
    ASSERT_EQ(y.sizes(), want.sizes());
    EXPECT_LT((y - want).abs().max().item<double>(), 1e-12) << "ctx " << ctx;
    torch::Tensor dy = torch::randn(y.sizes(), f64);
    y.backward(dy);
    want.backward(dy);
    EXPECT_LT((x.grad() - xr.grad()).abs().max().item<double>(), 1e-12) << "ctx " << ctx;
    EXPECT_LT((w.grad() - wr.grad()).abs().max().item<double>(), 1e-12) << "ctx " << ctx;
  }
  EXPECT_THROW(ShortConvSilu(torch::randn({1, 4, 6}), torch::randn({6, 1, 4}), 4), c10::Error);
  EXPECT_THROW(ShortConvSilu(torch::randn({1, 4, 6}), torch::randn({5, 1, 4}), 0), c10::Error);
}

TEST(FusedOps, RopeScoresDependOnlyOnTheDistanceOfPositions) {
  torch::manual_seed(2);
  const int64_t S = 9, D = 16;
  torch::Tensor q = torch::randn({1, 1, 1, D}, torch::kFloat64).expand({1, S, 1, D}).contiguous();
  torch::Tensor k = torch::randn({1, 1, 1, D}, torch::kFloat64).expand({1, S, 1, D}).contiguous();
  for (int64_t offset : {0, 5}) {
    auto [cos, sin] = Tables(1, S, D, torch::kFloat64, offset);
    torch::Tensor rq = Rope(q, cos, sin).squeeze(2).squeeze(0), rk = Rope(k, cos, sin).squeeze(2).squeeze(0);
    torch::Tensor scores = torch::matmul(rq, rk.t());  // (S, S): same q and k at every position
    for (int64_t d = -3; d <= 3; ++d) {  // every diagonal is constant
      torch::Tensor diag = scores.diagonal(d);
      EXPECT_LT((diag - diag[0]).abs().max().item<double>(), 1e-12) << "offset " << offset << " diagonal " << d;
    }
    EXPECT_LT((rq.norm(2, -1) - q.squeeze(2).squeeze(0).norm(2, -1)).abs().max().item<double>(), 1e-12);
  }
  // A rotation by a nonzero angle moves the vector.
  auto [cos, sin] = Tables(1, S, D, torch::kFloat64);
  EXPECT_GT((Rope(q, cos, sin) - q).abs().max().item<double>(), 1e-3);
}

TEST(FusedOps, AdamWReferenceMatchesTorchOptim) {
  torch::manual_seed(3);
  const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  torch::Tensor p = torch::randn({33, 7});
  torch::Tensor q = p.clone().requires_grad_(true);
  torch::optim::AdamW opt({q}, torch::optim::AdamWOptions(lr).betas({b1, b2}).eps(eps).weight_decay(wd));
  torch::Tensor m = torch::zeros_like(p), v = torch::zeros_like(p);
  const torch::Tensor half = torch::full({}, 0.5f);
  for (int step = 1; step <= 4; ++step) {
    torch::Tensor g = torch::randn_like(p);
    q.mutable_grad() = g * 0.5;
    opt.step();
    AdamWUpdate(p, g, p, m, v, half,
                {lr, b1, b2, eps, wd, 1 - std::pow(b1, step), 1 - std::pow(b2, step)});
    EXPECT_LT(MaxError(p, q), 1e-6) << "step " << step;
  }
  EXPECT_GT(MaxError(p, torch::zeros_like(p)), 0.1);
}

// ---- CUDA kernels ----

bool SkipUnlessKernels() {
  if (!torch::cuda::is_available()) return true;
  return !FusedKernelsBuilt();
}
#define SKIP_UNLESS_KERNELS()                                                            \
  if (SkipUnlessKernels()) {                                                             \
    GTEST_SKIP() << (torch::cuda::is_available() ? "a build without ODYSSEY_CUDA kernels" \
                                                 : "no CUDA device");                    \
  }

// Runs f with the kernels on (checking that at least one kernel launched) and off.
template <typename F>
auto KernelAndReference(F f) {
  SetFusedKernels(true);
  const int64_t before = FusedKernelLaunches();
  auto kernel = f();
  torch::cuda::synchronize();
  EXPECT_GT(FusedKernelLaunches(), before) << "the kernel path did not run";
  SetFusedKernels(false);
  auto reference = f();
  SetFusedKernels(true);
  return std::make_pair(kernel, reference);
}

torch::TensorOptions Bf16Cuda() { return torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA); }

TEST(FusedOps, RmsNorm_cuda) {
  SKIP_UNLESS_KERNELS();
  torch::manual_seed(4);
  for (int64_t H : {int64_t{3072}, int64_t{2056}, int64_t{136}, int64_t{16384}}) {
    const int64_t N = 1537;
    torch::Tensor x = torch::randn({N, H}, Bf16Cuda()) * 3, w = (torch::rand({H}, Bf16Cuda()) + 0.5);
    torch::Tensor g = torch::randn({N, H}, Bf16Cuda());
    torch::Tensor x64 = x.to(torch::kCPU, torch::kFloat64).requires_grad_(true);
    torch::Tensor w64 = w.to(torch::kCPU, torch::kFloat64).requires_grad_(true);
    torch::Tensor y64 = NormFormula(x64, w64);
    y64.backward(g.to(torch::kCPU, torch::kFloat64));
    auto [k, r] = KernelAndReference([&] {
      torch::Tensor rstd;
      torch::Tensor y = RmsNormRows(x, w, kEps, int64_t{64} << 20, &rstd);
      auto [dx, dw] = RmsNormRowsBackward(g, x, w, rstd, int64_t{64} << 20);
      return std::vector<torch::Tensor>{y, dx, dw, rstd};
    });
    const std::string at = "H=" + std::to_string(H);
    ExpectWithinBar("rmsnorm y " + at, k[0], r[0], y64);
    ExpectWithinBar("rmsnorm dx " + at, k[1], r[1], x64.grad());
    ExpectWithinBar("rmsnorm dw " + at, k[2], r[2], w64.grad());
    EXPECT_LT(MaxError(k[3], r[3]), 1e-5) << at;
  }
}

TEST(FusedOps, SwiGlu_cuda) {
  SKIP_UNLESS_KERNELS();
  torch::manual_seed(5);
  const std::vector<int64_t> shape = {999, 1001};  // 999,999 elements: a vector tail of 7
  torch::Tensor gate = torch::randn(shape, Bf16Cuda()) * 4, up = torch::randn(shape, Bf16Cuda());
  torch::Tensor dh = torch::randn(shape, Bf16Cuda());
  torch::Tensor g64 = gate.to(torch::kCPU, torch::kFloat64).requires_grad_(true);
  torch::Tensor u64 = up.to(torch::kCPU, torch::kFloat64).requires_grad_(true);
  torch::Tensor h64 = torch::silu(g64) * u64;
  h64.backward(dh.to(torch::kCPU, torch::kFloat64));
  auto [k, r] = KernelAndReference([&] {
    torch::Tensor ga = gate.clone().requires_grad_(true), ua = up.clone().requires_grad_(true);
    torch::Tensor h = SwiGlu(ga, ua);
    h.backward(dh);
    return std::vector<torch::Tensor>{h.detach(), ga.grad(), ua.grad()};
  });
  ExpectWithinBar("swiglu h", k[0], r[0], h64);
  ExpectWithinBar("swiglu d gate", k[1], r[1], g64.grad());
  ExpectWithinBar("swiglu d up", k[2], r[2], u64.grad());
}

TEST(FusedOps, ShortConvSilu_cuda) {
  SKIP_UNLESS_KERNELS();
  torch::manual_seed(10);
  // 333 rows: runs of 64 with a partial last one; 3072 channels as hybrid-3b's q, k, v.
  for (int64_t ctx : {0, 3}) {
    const int64_t B = 2, S = 333, Ch = 3072;
    torch::Tensor x = torch::randn({B, S, Ch}, Bf16Cuda()), w = torch::randn({Ch, 1, 4}, Bf16Cuda()) * 0.5;
    torch::Tensor dy = torch::randn({B, S - ctx, Ch}, Bf16Cuda());
    torch::Tensor x64 = x.to(torch::kCPU, torch::kFloat64).requires_grad_(true);
    torch::Tensor w64 = w.to(torch::kCPU, torch::kFloat64).requires_grad_(true);
    torch::Tensor y64 = ShortConvSiluFormula(x64, w64, ctx);
    y64.backward(dy.to(torch::kCPU, torch::kFloat64));
    const int64_t launches = FusedKernelLaunches();
    auto [k, r] = KernelAndReference([&] {
      torch::Tensor xa = x.clone().requires_grad_(true), wa = w.clone().requires_grad_(true);
      torch::Tensor y = ShortConvSilu(xa, wa, ctx);
      y.backward(dy);
      return std::vector<torch::Tensor>{y.detach(), xa.grad(), wa.grad()};
    });
    EXPECT_GE(FusedKernelLaunches() - launches, 2) << "the short conv kernels did not run";
    const std::string c = " ctx " + std::to_string(ctx);
    ExpectWithinBar("short conv y" + c, k[0], r[0], y64);
    ExpectWithinBar("short conv dx" + c, k[1], r[1], x64.grad());
    ExpectWithinBar("short conv dw" + c, k[2], r[2], w64.grad());
  }
}

TEST(FusedOps, Rope_cuda) {
  SKIP_UNLESS_KERNELS();
  torch::manual_seed(6);
  const int64_t B = 2, S = 333, Hh = 6, D = 128;
  auto [cos, sin] = Tables(B, S, D, Bf16Cuda(), /*offset=*/1000);
  torch::Tensor x = torch::randn({B, S, Hh, D}, Bf16Cuda()), dy = torch::randn({B, S, Hh, D}, Bf16Cuda());
  torch::Tensor x64 = x.to(torch::kCPU, torch::kFloat64).requires_grad_(true);
  torch::Tensor c64 = cos.to(torch::kCPU, torch::kFloat64).unsqueeze(2), s64 = sin.to(torch::kCPU, torch::kFloat64).unsqueeze(2);
  torch::Tensor rot = torch::cat({-x64.narrow(-1, D / 2, D / 2), x64.narrow(-1, 0, D / 2)}, -1);
  torch::Tensor y64 = x64 * c64 + rot * s64;
  y64.backward(dy.to(torch::kCPU, torch::kFloat64));
  auto [k, r] = KernelAndReference([&] {
    torch::Tensor xa = x.clone().requires_grad_(true);
    torch::Tensor y = Rope(xa, cos, sin);
    y.backward(dy);
    return std::vector<torch::Tensor>{y.detach(), xa.grad()};
  });
  ExpectWithinBar("rope y", k[0], r[0], y64);
  ExpectWithinBar("rope dx", k[1], r[1], x64.grad());
}

TEST(FusedOps, AddLinear_cuda) {
  SKIP_UNLESS_KERNELS();
  torch::manual_seed(7);
  torch::Tensor res = torch::randn({2, 301, 384}, Bf16Cuda()), x = torch::randn({2, 301, 520}, Bf16Cuda());
  torch::Tensor w = torch::randn({384, 520}, Bf16Cuda()) * 0.05;
  torch::Tensor truth = res.to(torch::kCPU, torch::kFloat64) +
                        torch::matmul(x.to(torch::kCPU, torch::kFloat64), w.to(torch::kCPU, torch::kFloat64).t());
  SetFusedKernels(true);
  torch::Tensor k = AddLinear(res, x, w);
  SetFusedKernels(false);
  torch::Tensor r = AddLinear(res, x, w);
  SetFusedKernels(true);
  ExpectWithinBar("residual + linear", k, r, truth);
}

TEST(FusedOps, AdamW_cuda) {
  SKIP_UNLESS_KERNELS();
  torch::manual_seed(8);
  const int64_t n = 1000003;
  const double lr = 3e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA);
  torch::Tensor master0 = torch::randn({n}, f32);
  std::vector<torch::Tensor> grads;
  for (int i = 0; i < 3; ++i) grads.push_back(torch::randn({n}, Bf16Cuda()));
  const torch::Tensor scale = torch::full({}, 0.7f, f32);
  // Truth in fp64 on the CPU.
  torch::Tensor m64 = master0.to(torch::kCPU, torch::kFloat64), e1 = torch::zeros_like(m64), e2 = torch::zeros_like(m64);
  for (int i = 0; i < 3; ++i) {
    const int step = i + 1;
    torch::Tensor g = grads[i].to(torch::kCPU, torch::kFloat64) * 0.7;
    m64 = m64 * (1 - lr * wd);
    e1 = b1 * e1 + (1 - b1) * g;
    e2 = b2 * e2 + (1 - b2) * g * g;
    m64 = m64 - lr / (1 - std::pow(b1, step)) * e1 / (e2.sqrt() / std::sqrt(1 - std::pow(b2, step)) + eps);
  }
  auto [k, r] = KernelAndReference([&] {
    torch::Tensor param = master0.to(torch::kBFloat16), master = master0.clone();
    torch::Tensor m = torch::zeros_like(master), v = torch::zeros_like(master);
    for (int i = 0; i < 3; ++i) {
      const int step = i + 1;
      AdamWUpdate(param, grads[i], master, m, v, scale,
                  {lr, b1, b2, eps, wd, 1 - std::pow(b1, step), 1 - std::pow(b2, step)});
    }
    return std::vector<torch::Tensor>{master, param};
  });
  ExpectWithinBar("adamw master", k[0], r[0], m64);
  EXPECT_TRUE(torch::equal(k[1], k[0].to(torch::kBFloat16))) << "the parameter is the rounded master";
  EXPECT_GT(MaxError(k[0], master0), 1e-3) << "the update moved the weights";
}

}  // namespace
}  // namespace odyssey::kernels
