// odyssey-kda-phase-clock: where chunked KDA's intra-chunk backward kernel spends its time, phase
// by phase (GPU only; built with ODYSSEY_CUDA). It runs the kernel's own block code
// (kda_intra_backward_body.h) over hybrid-3b's shape (bf16 q, k, v; fp32 beta and G; C = 64,
// K = V = 128; the whole-chunk Gram form on the tensor cores: the model's default), once to warm
// up and once timed, with thread 0 of every block reading clock64() after each phase's barrier
// and adding the phase's cycles to a counter. It prints the timed launch's milliseconds and a
// table of the mean cycles a block per phase. The inputs are a fixed hash of their index, not a
// model's values: the kernel's work and memory traffic do not depend on them (G is kept small, so
// no exponent overflows).
//
// Usage: odyssey-kda-phase-clock [--tokens N] [--heads H]   (defaults 262144 and 24)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/cuda/kda_intra.h"
#include "kernels/cuda/kda_intra_backward.h"
#include "kernels/cuda/kda_intra_backward_body.h"

namespace odyssey::kernels::cuda {
namespace {

constexpr int kC = 64, kK = 128, kV = 128;
constexpr int kMaxPhases = 64;
static_assert(kda_bwd::Phases(kC) <= kMaxPhases, "a counter per phase");

__device__ unsigned long long phase_cycles[kMaxPhases];

// IntraBackwardKernel<64, 128, whole chunk, tensor cores, bf16> (kda_intra_backward.cu) with the
// clock read after each phase's barrier.
__global__ void __launch_bounds__(kKdaIntraBackwardThreads) ClockedKernel(KdaIntraBackwardArgs a) {
  extern __shared__ float sm[];
  kda_bwd::Carry<kC, kK, true> carry;
  long long t = clock64();
  for (int phase = 0; phase < kda_bwd::Phases(kC); ++phase) {
    kda_bwd::KdaIntraBackwardPhase<kC, kK, false, true, true>(phase, a, sm, blockIdx.y, blockIdx.x, threadIdx.x,
                                                              kKdaIntraBackwardThreads, carry);
    __syncthreads();
    if (threadIdx.x == 0) {
      const long long now = clock64();
      atomicAdd(&phase_cycles[phase], static_cast<unsigned long long>(now - t));
      t = now;
    }
  }
}

// n values of scale * (a hash of the index in [0, 1) - 0.5), bf16 or fp32.
__global__ void Fill(void* p, size_t n, float scale, bool bf16, unsigned seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed * 40503u;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float f = scale * ((h & 0xffffff) / 16777216.f - 0.5f);
    if (bf16) {
      static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(__float_as_uint(f) >> 16);
    } else {
      static_cast<float*>(p)[i] = f;
    }
  }
}

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "odyssey-kda-phase-clock: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

// A device buffer of `bytes` filled by Fill, or null (reported) if it cannot be had.
void* Filled(size_t bytes, float scale, bool bf16, unsigned seed) {
  void* p = nullptr;
  if (!Check(cudaMalloc(&p, bytes), "cudaMalloc")) return nullptr;
  Fill<<<1024, 256>>>(p, bf16 ? bytes / 2 : bytes / 4, scale, bf16, seed);
  return Check(cudaGetLastError(), "fill") ? p : nullptr;
}

// What phase p of the C = 64 block does (kda_intra_backward_body.h, KdaIntraBackwardPhase).
std::string PhaseName(int p) {
  constexpr int kRows = kC / kda_bwd::kB - 1;
  const char* lead[] = {"beta", "factors", "Grams", "Y, the inverse's diagonal blocks"};
  if (p < 4) return lead[p];
  if (p < 4 + 2 * kRows) {
    return "inverse, block row " + std::to_string(1 + (p - 4) / 2) + ((p - 4) % 2 == 0 ? ": product" : ": solve");
  }
  const char* rest[] = {"GradT", "GradXY", "GradR", "GradAkk", "GradL", "GradQK", "last (dg, dbeta)"};
  return rest[p - 4 - 2 * kRows];
}

// A positive whole number of at most `max`, or -1.
int64_t Positive(const char* s, int64_t max) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  return end != s && *end == '\0' && v > 0 && v <= max ? v : -1;
}

int Run(int argc, char** argv) {
  int64_t L = 262144, HV = 24;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if ((flag == "--tokens" || flag == "--heads") && i + 1 < argc) {
      const int64_t v = Positive(argv[++i], flag == "--tokens" ? (int64_t{1} << 24) : 4096);
      if (v < 0) {
        std::fprintf(stderr, "odyssey-kda-phase-clock: %s wants a whole number from 1 to %s\n", flag.c_str(),
                     flag == "--tokens" ? "16777216" : "4096");
        return 2;
      }
      (flag == "--tokens" ? L : HV) = v;
    } else {
      std::fprintf(stderr, "usage: odyssey-kda-phase-clock [--tokens N] [--heads H]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "odyssey-kda-phase-clock: no CUDA device\n");
    return 1;
  }
  const int64_t N = (L + kC - 1) / kC, BH = HV, ck = BH * N * kC * kK * 4, cv = BH * N * kC * kV * 4;
  KdaIntraBackwardArgs a{};
  a.B = 1, a.HV = HV, a.N = N, a.C = kC, a.K = kK, a.V = kV, a.L = L, a.tf32 = true, a.sub_blocks = false;
  a.bf16 = kKdaBf16Q | kKdaBf16K | kKdaBf16V, a.q_scale = 0.088f;
  // q, k, v as the model holds them: (B, T, HV, D) read through strides (token HV D, head D).
  a.q_sb = a.k_sb = L * HV * kK, a.q_sh = a.k_sh = kK, a.q_st = a.k_st = HV * kK;
  a.v_sb = L * HV * kV, a.v_sh = kV, a.v_st = HV * kV;
  a.b_sb = L * HV, a.b_sh = 1, a.b_st = HV;
  a.q = Filled(L * HV * kK * 2, 1.f, true, 1), a.k = Filled(L * HV * kK * 2, 0.2f, true, 2);
  a.v = Filled(L * HV * kV * 2, 1.f, true, 3), a.beta = Filled(L * HV * 4, 1.f, false, 4);
  a.G = static_cast<const float*>(Filled(ck, 0.5f, false, 5));
  a.dqg = static_cast<const float*>(Filled(ck, 1.f, false, 6));
  a.dkg = static_cast<const float*>(Filled(ck, 1.f, false, 7));
  a.dW = static_cast<const float*>(Filled(ck, 1.f, false, 8));
  a.dU = static_cast<const float*>(Filled(cv, 1.f, false, 9));
  a.dAqk = static_cast<const float*>(Filled(BH * N * kC * kC * 4, 1.f, false, 10));
  a.deGC = static_cast<const float*>(Filled(BH * N * kK * 4, 1.f, false, 11));
  // The input gradients as the model's backward takes them: dq, dk, dv bf16 in q's layout (B, T,
  // HV, D), dg fp32 (B, HV, T, K) (the gate's dtype), dbeta fp32 (B, HV, T).
  auto out = [](void* p, int64_t sb, int64_t sh, int64_t st, bool bf16) { return KdaGradOut{p, sb, sh, st, bf16}; };
  a.dq = out(Filled(L * HV * kK * 2, 0.f, true, 0), L * HV * kK, kK, HV * kK, true);
  a.dk = out(Filled(L * HV * kK * 2, 0.f, true, 0), L * HV * kK, kK, HV * kK, true);
  a.dv = out(Filled(L * HV * kV * 2, 0.f, true, 0), L * HV * kV, kV, HV * kV, true);
  a.dg = out(Filled(L * HV * kK * 4, 0.f, false, 0), L * HV * kK, L * kK, kK, false);
  a.dbeta = out(Filled(L * HV * 4, 0.f, false, 0), L * HV, L, 1, false);
  a.dq_scale = a.q_scale;
  for (const void* p : {a.q, a.k, a.v, a.beta, static_cast<const void*>(a.G), static_cast<const void*>(a.dqg),
                        static_cast<const void*>(a.dkg), static_cast<const void*>(a.dW),
                        static_cast<const void*>(a.dU), static_cast<const void*>(a.dAqk),
                        static_cast<const void*>(a.deGC), static_cast<const void*>(a.dq.p),
                        static_cast<const void*>(a.dk.p), static_cast<const void*>(a.dg.p),
                        static_cast<const void*>(a.dv.p), static_cast<const void*>(a.dbeta.p)}) {
    if (p == nullptr) return 1;
  }
  const size_t smem = static_cast<size_t>(kda_bwd::SmemFloats(kC, kK, kV, true)) * sizeof(float);
  if (!Check(cudaFuncSetAttribute(ClockedKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
             "shared memory")) {
    return 1;
  }
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(BH));
  ClockedKernel<<<grid, kKdaIntraBackwardThreads, smem>>>(a);  // warm-up
  if (!Check(cudaDeviceSynchronize(), "warm-up launch")) return 1;
  const unsigned long long zeros[kMaxPhases] = {};
  if (!Check(cudaMemcpyToSymbol(phase_cycles, zeros, sizeof zeros), "counters")) return 1;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  ClockedKernel<<<grid, kKdaIntraBackwardThreads, smem>>>(a);
  cudaEventRecord(e1);
  if (!Check(cudaEventSynchronize(e1), "timed launch")) return 1;
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  unsigned long long cycles[kMaxPhases];
  if (!Check(cudaMemcpyFromSymbol(cycles, phase_cycles, sizeof cycles), "counters")) return 1;
  const double blocks = static_cast<double>(N * BH);
  double total = 0;
  for (int p = 0; p < kda_bwd::Phases(kC); ++p) total += cycles[p] / blocks;
  std::printf("intra backward, %lld tokens x %lld heads (C %d, K = V = %d, bf16, tensor cores): %.3f ms, %.0f cycles a block, %zu B shared memory\n",
              static_cast<long long>(L), static_cast<long long>(HV), kC, kK, ms, total, smem);
  std::printf("| phase | what | cycles a block | share |\n| --- | --- | --- | --- |\n");
  for (int p = 0; p < kda_bwd::Phases(kC); ++p) {
    std::printf("| %d | %s | %.0f | %.1f%% |\n", p, PhaseName(p).c_str(), cycles[p] / blocks, 100 * cycles[p] / blocks / total);
  }
  return 0;
}

}  // namespace
}  // namespace odyssey::kernels::cuda

int main(int argc, char** argv) { return odyssey::kernels::cuda::Run(argc, argv); }
