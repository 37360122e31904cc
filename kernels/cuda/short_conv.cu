// KDA's short convolution fused with its SiLU (see short_conv.h). A thread owns adjacent
// channels (8 forward, one 16-byte load of bf16 per row; 4 backward, which keeps three windows
// in registers), so a warp's loads of a row are contiguous.
//   Forward: one thread per (row, 8 channels); the Kw input rows it reads are its neighbours'
//   too (cache hits), so x is read from memory about once.
//   Backward: one thread per (run of kRun output rows, 4 channels) walking t upwards with the last
//   Kw rows of x (for pre) and of d pre (for dx) in registers: every x and dy row is read once
//   per run (plus Kw - 1 rows of warm-up), dx written once; dw's Kw x 4 sums of the run in
//   registers, written as partial sums and added up by a second kernel in run order.
#include "kernels/cuda/short_conv.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace odyssey::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRun = 64;  // output rows per backward thread

__device__ __forceinline__ void Load8(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x, f[2 * i + 1] = v.y;
  }
}

__device__ __forceinline__ void Store8(__nv_bfloat16* p, const float (&f)[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

__device__ __forceinline__ void Load4(const __nv_bfloat16* p, float (&f)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
  const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
}

__device__ __forceinline__ void Store4(__nv_bfloat16* p, const float (&f)[4]) {
  uint2 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
  h[0] = __floats2bfloat162_rn(f[0], f[1]);
  h[1] = __floats2bfloat162_rn(f[2], f[3]);
  *reinterpret_cast<uint2*>(p) = u;
}

__device__ __forceinline__ float Sigmoid(float z) { return 1.f / (1.f + __expf(-z)); }

// The filter taps of channels c0 .. c0 + N - 1: w[c][j] -> wf[j][c - c0].
template <int Kw, int N>
__device__ __forceinline__ void LoadTaps(const __nv_bfloat16* w, int64_t c0, float (&wf)[Kw][N]) {
#pragma unroll
  for (int c = 0; c < N; ++c) {
#pragma unroll
    for (int j = 0; j < Kw; ++j) wf[j][c] = __bfloat162float(w[(c0 + c) * Kw + j]);
  }
}

template <int Kw>
__global__ void __launch_bounds__(kThreads)
    ForwardKernel(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int64_t B, int64_t S, int64_t Ch,
                  int64_t ctx) {
  const int64_t groups = Ch / 8, n = S - ctx, total = B * n * groups;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = idx % groups, bt = idx / groups, t = bt % n, b = bt / n, c0 = g * 8;
    float wf[Kw][8];
    LoadTaps<Kw, 8>(w, c0, wf);
    float acc[8] = {};
#pragma unroll
    for (int j = 0; j < Kw; ++j) {
      const int64_t s = ctx + t - (Kw - 1) + j;
      if (s < 0) continue;
      float xv[8];
      Load8(x + (b * S + s) * Ch + c0, xv);
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] = fmaf(wf[j][c], xv[c], acc[c]);
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = acc[c] * Sigmoid(acc[c]);
    Store8(y + (b * n + t) * Ch + c0, acc);
  }
}

// Thread (b, run, 4 channels): output rows s in [s0, s1) of dx, s0 = run * kRun. dx[s] = sum_j w[j]
// dpre[t - j] with t = s + Kw - 1 - ctx, so the walk runs t from s0 - ctx (the first d pre that
// row s0 needs) to s1 - 1 - ctx + Kw - 1. dw sums dpre[t] x[ctx + t - (Kw - 1) + j] over the t
// whose row s = clamp(t + ctx - (Kw - 1), 0, S - 1) is the run's (each t in [0, n) once).
template <int Kw>
__global__ void __launch_bounds__(kThreads)
    BackwardKernel(const __nv_bfloat16* dy, const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* dx,
                   float* partial, int64_t B, int64_t S, int64_t Ch, int64_t ctx) {
  const int64_t groups = Ch / 4, n = S - ctx, runs = (S + kRun - 1) / kRun, total = B * runs * groups;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= total) return;
  const int64_t g = idx % groups, br = idx / groups, run = br % runs, b = br / runs, c0 = g * 4;
  const int64_t s0 = run * kRun, s1 = s0 + kRun < S ? s0 + kRun : S;
  float wf[Kw][4];
  LoadTaps<Kw, 4>(w, c0, wf);
  const __nv_bfloat16* xb = x + b * S * Ch + c0;
  const __nv_bfloat16* dyb = dy + b * n * Ch + c0;
  // xw[j]: x row ctx + t - (Kw - 1) + j for the current t; dpw[j]: d pre at t - j.
  float xw[Kw][4], dpw[Kw][4], dws[Kw][4];
  const int64_t t_first = s0 - ctx;
#pragma unroll
  for (int j = 0; j < Kw; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) xw[j][c] = 0.f, dpw[j][c] = 0.f, dws[j][c] = 0.f;
  }
  // The rows before the walk's first: xw[1 .. Kw - 1] hold rows ctx + t_first - (Kw - 1) ..
  // ctx + t_first - 1 (shifted down to 0 .. Kw - 2 at the first step).
#pragma unroll
  for (int j = 1; j < Kw; ++j) {
    const int64_t r = ctx + t_first - Kw + j;
    if (r >= 0 && r < S) Load4(xb + r * Ch, xw[j]);
  }
  for (int64_t t = t_first; t <= s1 - 1 - ctx + Kw - 1; ++t) {
    // Shift the windows by one row.
#pragma unroll
    for (int j = 0; j < Kw - 1; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) xw[j][c] = xw[j + 1][c];
    }
#pragma unroll
    for (int j = Kw - 1; j > 0; --j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) dpw[j][c] = dpw[j - 1][c];
    }
    const int64_t r = ctx + t;  // the newest x row
#pragma unroll
    for (int c = 0; c < 4; ++c) xw[Kw - 1][c] = 0.f;
    if (r >= 0 && r < S) Load4(xb + r * Ch, xw[Kw - 1]);
    float dp[4] = {};
    if (t >= 0 && t < n) {
      float g4[4];
      Load4(dyb + t * Ch, g4);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float pre = 0.f;
#pragma unroll
        for (int j = 0; j < Kw; ++j) pre = fmaf(wf[j][c], xw[j][c], pre);
        const float sg = Sigmoid(pre);
        dp[c] = g4[c] * sg * (1.f + pre * (1.f - sg));
      }
      int64_t s_own = t + ctx - (Kw - 1);
      s_own = s_own < 0 ? 0 : s_own;
      if (s_own >= s0 && s_own < s1) {
#pragma unroll
        for (int j = 0; j < Kw; ++j) {
#pragma unroll
          for (int c = 0; c < 4; ++c) dws[j][c] = fmaf(dp[c], xw[j][c], dws[j][c]);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) dpw[0][c] = dp[c];
    const int64_t s = t + ctx - (Kw - 1);
    if (s >= s0 && s < s1) {
      float d[4] = {};
#pragma unroll
      for (int j = 0; j < Kw; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) d[c] = fmaf(wf[j][c], dpw[j][c], d[c]);
      }
      Store4(dx + (b * S + s) * Ch + c0, d);
    }
  }
  float* out = partial + ((b * runs + run) * Ch + c0) * Kw;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
#pragma unroll
    for (int j = 0; j < Kw; ++j) out[c * Kw + j] = dws[j][c];
  }
}

// dw[e] = sum over (b, run) of partial[(b, run)][e], e over Ch * Kw, in (b, run) order.
__global__ void __launch_bounds__(kThreads) SumPartials(const float* partial, float* dw, int64_t parts, int64_t m) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= m) return;
  float s = 0.f;
  for (int64_t p = 0; p < parts; ++p) s += partial[p * m + e];
  dw[e] = s;
}

bool Valid(int64_t B, int64_t S, int64_t Ch, int64_t Kw, int64_t ctx) {
  return B > 0 && S > 0 && Ch > 0 && Ch % 8 == 0 && Kw >= 2 && Kw <= 4 && ctx >= 0 && ctx < S;
}

unsigned Blocks(int64_t total) {
  const int64_t b = (total + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 2147483647 ? b : 2147483647);
}

}  // namespace

int ShortConvSiluForward(const void* x, const void* w, void* y, int64_t B, int64_t S, int64_t Ch, int64_t Kw,
                         int64_t ctx, void* stream) {
  if (!Valid(B, S, Ch, Kw, ctx)) return static_cast<int>(cudaErrorInvalidValue);
  const auto* xp = static_cast<const __nv_bfloat16*>(x);
  const auto* wp = static_cast<const __nv_bfloat16*>(w);
  auto* yp = static_cast<__nv_bfloat16*>(y);
  const unsigned blocks = Blocks(B * (S - ctx) * (Ch / 8));
  const auto s = static_cast<cudaStream_t>(stream);
  if (Kw == 4) ForwardKernel<4><<<blocks, kThreads, 0, s>>>(xp, wp, yp, B, S, Ch, ctx);
  if (Kw == 3) ForwardKernel<3><<<blocks, kThreads, 0, s>>>(xp, wp, yp, B, S, Ch, ctx);
  if (Kw == 2) ForwardKernel<2><<<blocks, kThreads, 0, s>>>(xp, wp, yp, B, S, Ch, ctx);
  return static_cast<int>(cudaGetLastError());
}

int64_t ShortConvBackwardScratch(int64_t B, int64_t S, int64_t Ch, int64_t Kw) {
  return B * ((S + kRun - 1) / kRun) * Ch * Kw;
}

int ShortConvSiluBackward(const void* dy, const void* x, const void* w, void* dx, float* dw, float* partial,
                          int64_t B, int64_t S, int64_t Ch, int64_t Kw, int64_t ctx, void* stream) {
  if (!Valid(B, S, Ch, Kw, ctx)) return static_cast<int>(cudaErrorInvalidValue);
  const auto* dyp = static_cast<const __nv_bfloat16*>(dy);
  const auto* xp = static_cast<const __nv_bfloat16*>(x);
  const auto* wp = static_cast<const __nv_bfloat16*>(w);
  auto* dxp = static_cast<__nv_bfloat16*>(dx);
  const int64_t runs = (S + kRun - 1) / kRun;
  const unsigned blocks = Blocks(B * runs * (Ch / 4));
  const auto s = static_cast<cudaStream_t>(stream);
  if (Kw == 4) BackwardKernel<4><<<blocks, kThreads, 0, s>>>(dyp, xp, wp, dxp, partial, B, S, Ch, ctx);
  if (Kw == 3) BackwardKernel<3><<<blocks, kThreads, 0, s>>>(dyp, xp, wp, dxp, partial, B, S, Ch, ctx);
  if (Kw == 2) BackwardKernel<2><<<blocks, kThreads, 0, s>>>(dyp, xp, wp, dxp, partial, B, S, Ch, ctx);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return static_cast<int>(e);
  SumPartials<<<Blocks(Ch * Kw), kThreads, 0, s>>>(partial, dw, B * runs, Ch * Kw);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace odyssey::kernels::cuda
