// odyssey-kernel-bench: the fused kernels against their libtorch reference ops at the sizes of
// one 64K-token step of a Llama-3.2-3B layer (or --tokens), on one CUDA device. Prints, per op,
// the time of each path, the bytes the kernel must move (each input read once, each output
// written once) over its time as GB/s, and that as a share of the device-to-device copy rate
// measured on an H200 (4.3 TB/s; --peak-gbs to change). One JSON line per op with --json.
//
//   build-gpu/kernels/odyssey-kernel-bench --tokens 65536 --json out/kernels.jsonl
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>

#include <torch/torch.h>

#include "kernels/fused_ops.h"

namespace {

using odyssey::kernels::SetFusedKernels;

double Seconds(const std::function<void()>& f, int iters) {
  for (int i = 0; i < 3; ++i) f();
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  torch::cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

struct Report {
  std::string json_path;
  double peak_gbs = 4300;
  void Row(const std::string& op, double bytes, const std::function<void()>& f, int iters = 20) {
    SetFusedKernels(true);
    const double kernel = Seconds(f, iters);
    SetFusedKernels(false);
    const double reference = Seconds(f, iters);
    SetFusedKernels(true);
    const double gbs = bytes / kernel / 1e9;
    std::printf("| %-22s | %8.3f ms | %8.3f ms | %5.2fx | %7.0f GB/s | %4.0f%% |\n", op.c_str(), kernel * 1e3,
                reference * 1e3, reference / kernel, gbs, 100 * gbs / peak_gbs);
    std::fflush(stdout);
    if (!json_path.empty()) {
      std::ofstream out(json_path, std::ios::app);
      out << "{\"op\":\"" << op << "\",\"kernel_ms\":" << kernel * 1e3 << ",\"reference_ms\":" << reference * 1e3
          << ",\"bytes\":" << bytes << ",\"kernel_gbs\":" << gbs << ",\"peak_gbs\":" << peak_gbs << "}\n";
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 65536, hidden = 3072, intermediate = 8192, heads = 24, kv_heads = 8, head_dim = 128;
  int64_t params = 3212749824;  // Llama-3.2-3B
  Report report;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--tokens") tokens = std::stoll(v);
    else if (a == "--json") report.json_path = v;
    else if (a == "--peak-gbs") report.peak_gbs = std::stod(v);
    else if (a == "--params") params = std::stoll(v);
    else {
      std::fprintf(stderr, "unknown option %s (options: --tokens N --json PATH --peak-gbs X --params N)\n", a.c_str());
      return 2;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "option %s needs a value\n", argv[argc - 1]);
    return 2;
  }
  if (!torch::cuda::is_available() || !odyssey::kernels::FusedKernelsBuilt()) {
    std::fprintf(stderr, "odyssey-kernel-bench needs a CUDA device and a build with ODYSSEY_CUDA\n");
    return 2;
  }
  torch::NoGradGuard no_grad;
  auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  auto f32 = bf16.dtype(torch::kFloat32);
  std::printf("| op (%lld tokens) | kernel | reference | speed-up | kernel GB/s | of %.0f GB/s |\n",
              static_cast<long long>(tokens), report.peak_gbs);
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  const double N = static_cast<double>(tokens), H = static_cast<double>(hidden);
  {
    torch::Tensor x = torch::randn({tokens, hidden}, bf16), w = torch::rand({hidden}, bf16) + 0.5;
    torch::Tensor g = torch::randn({tokens, hidden}, bf16), rstd;
    odyssey::kernels::RmsNormRows(x, w, 1e-5, int64_t{64} << 20, &rstd);
    report.Row("rmsnorm forward", N * H * 4 + N * 4,
               [&] { odyssey::kernels::RmsNormRows(x, w, 1e-5, int64_t{64} << 20, nullptr); });
    report.Row("rmsnorm backward", N * H * 6 + N * 4,
               [&] { odyssey::kernels::RmsNormRowsBackward(g, x, w, rstd, int64_t{64} << 20); });
  }
  {
    // One MLP tile of 16384 tokens (the tiled MLP never holds more).
    const int64_t t = std::min<int64_t>(tokens, 16384);
    const double n = static_cast<double>(t * intermediate);
    torch::Tensor gate = torch::randn({t, intermediate}, bf16), up = torch::randn({t, intermediate}, bf16);
    torch::Tensor dh = torch::randn({t, intermediate}, bf16);
    report.Row("swiglu forward (tile)", n * 6, [&] { odyssey::kernels::SwiGlu(gate, up); });
    torch::Tensor ga = gate.clone().requires_grad_(true), ua = up.clone().requires_grad_(true);
    report.Row("swiglu fwd+bwd (tile)", n * 6 + n * 10, [&] {
      torch::AutoGradMode grad(true);
      odyssey::kernels::SwiGlu(ga, ua).backward(dh);
      ga.mutable_grad() = torch::Tensor();
      ua.mutable_grad() = torch::Tensor();
    });
  }
  {
    torch::Tensor q = torch::randn({1, tokens, heads, head_dim}, bf16);
    torch::Tensor k = torch::randn({1, tokens, kv_heads, head_dim}, bf16);
    torch::Tensor ang = torch::rand({1, tokens, head_dim}, f32) * 100;
    torch::Tensor cos = ang.cos().to(torch::kBFloat16), sin = ang.sin().to(torch::kBFloat16);
    const double n = N * static_cast<double>((heads + kv_heads) * head_dim);
    report.Row("rope q+k forward", n * 4 + N * head_dim * 4 * 2, [&] {
      odyssey::kernels::Rope(q, cos, sin);
      odyssey::kernels::Rope(k, cos, sin);
    });
  }
  {
    // AdamW over 1/8 of the model's parameters per call (the fp32 state of all of them is 38 GB).
    const int64_t n = params / 8;
    torch::Tensor p = torch::randn({n}, bf16), g = torch::randn({n}, bf16) * 1e-3;
    torch::Tensor master = p.to(torch::kFloat32), m = torch::zeros({n}, f32), v = torch::zeros({n}, f32);
    torch::Tensor scale = torch::ones({}, f32);
    report.Row("adamw (1/8 of params)", static_cast<double>(n) * 28, [&] {
      odyssey::kernels::AdamWUpdate(p, g, master, m, v, scale, {1e-4, 0.9, 0.95, 1e-8, 0.1, 0.5, 0.5});
    }, 10);
  }
  std::printf("kernel launches: %lld\n", static_cast<long long>(odyssey::kernels::FusedKernelLaunches()));
  return 0;
}
