// odyssey's memory-bound kernels around the matmuls (see fused_ops.h). Each reads its inputs
// once and writes its outputs once, in bf16 with fp32 math in registers: what a chain of ATen
// ops would do in 4-10 passes over fp32 temporaries.
#include "kernels/cuda/fused_ops.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

namespace odyssey::kernels::cuda {
namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The sum of v over the block, returned to every thread. Safe to call repeatedly: the leading
// barrier keeps a fast warp from overwriting the previous call's partials before all have read.
__device__ __forceinline__ float BlockSum(float v) {
  __shared__ float partial[32];
  v = WarpSum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  return WarpSum(lane < warps ? partial[lane] : 0.f);
}

// 8 bf16 <-> 8 fp32 through one 16-byte access.
__device__ __forceinline__ void Load8(const bf16* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    out[2 * j] = f.x;
    out[2 * j + 1] = f.y;
  }
}
__device__ __forceinline__ void Store8(bf16* p, const float* in) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(in[2 * j], in[2 * j + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ float RoundBf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// K column chunks of 8 per thread: thread t holds columns (k * blockDim + t) * 8 .. + 8. Blocks
// of up to 1024 threads (K > 1 only beyond H = 8192): launch bounds keep them launchable.
template <int K>
__global__ void __launch_bounds__(1024) RmsNormForwardKernel(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ y,
                                     float* __restrict__ rstd, int H, float eps) {
  const int64_t row = blockIdx.x;
  const bf16* xr = x + row * H;
  float v[K][8];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int col = (k * blockDim.x + threadIdx.x) * 8;
    if (col < H) {
      Load8(xr + col, v[k]);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += v[k][j] * v[k][j];
    }
  }
  const float r = rsqrtf(BlockSum(ss) / static_cast<float>(H) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int col = (k * blockDim.x + threadIdx.x) * 8;
    if (col < H) {
      float wv[8], o[8];
      Load8(w + col, wv);
      // transformers' order: normalize in fp32, round to the input dtype, then scale.
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = wv[j] * RoundBf16(v[k][j] * r);
      Store8(y + row * H + col, o);
    }
  }
}

template <int K>
__global__ void __launch_bounds__(1024) RmsNormBackwardKernel(const bf16* __restrict__ g, const bf16* __restrict__ x,
                                      const bf16* __restrict__ w, const float* __restrict__ rstd,
                                      bf16* __restrict__ dx, float* __restrict__ partial, int64_t N, int H) {
  float wv[K][8], dwp[K][8];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int col = (k * blockDim.x + threadIdx.x) * 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) dwp[k][j] = 0.f;
    if (col < H) Load8(w + col, wv[k]);
  }
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const float r = rstd[row];
    float n[K][8], dn[K][8];
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int col = (k * blockDim.x + threadIdx.x) * 8;
      if (col < H) {
        float gv[8];
        Load8(x + row * H + col, n[k]);
        Load8(g + row * H + col, gv);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          n[k][j] *= r;
          dn[k][j] = gv[j] * wv[k][j];
          dot += dn[k][j] * n[k][j];
          dwp[k][j] += gv[j] * RoundBf16(n[k][j]);  // d y / d w = the rounded normalized input
        }
      }
    }
    const float mean = BlockSum(dot) / static_cast<float>(H);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int col = (k * blockDim.x + threadIdx.x) * 8;
      if (col < H) {
        float o[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = r * (dn[k][j] - n[k][j] * mean);
        Store8(dx + row * H + col, o);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int col = (k * blockDim.x + threadIdx.x) * 8;
    if (col < H) {
#pragma unroll
      for (int j = 0; j < 8; ++j) partial[static_cast<int64_t>(blockIdx.x) * H + col + j] = dwp[k][j];
    }
  }
}

// dw[c] = sum over the G block partials of column c.
__global__ void ColumnSumKernel(const float* __restrict__ partial, float* __restrict__ dw, int G, int H) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= H) return;
  float s = 0.f;
  for (int b = 0; b < G; ++b) s += partial[static_cast<int64_t>(b) * H + c];
  dw[c] = s;
}

__device__ __forceinline__ float Sigmoid(float v) { return 1.f / (1.f + __expf(-v)); }

__global__ void SwiGluForwardKernel(const bf16* __restrict__ gate, const bf16* __restrict__ up, bf16* __restrict__ h,
                                    int64_t n, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (int64_t i = first; i < n / 8; i += stride) {
      float gv[8], uv[8], o[8];
      Load8(gate + i * 8, gv);
      Load8(up + i * 8, uv);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = gv[j] * Sigmoid(gv[j]) * uv[j];
      Store8(h + i * 8, o);
    }
  }
  for (int64_t i = (vec ? n / 8 * 8 : 0) + first; i < n; i += stride) {
    const float gv = __bfloat162float(gate[i]);
    h[i] = __float2bfloat16_rn(gv * Sigmoid(gv) * __bfloat162float(up[i]));
  }
}

__device__ __forceinline__ void SwiGluGrad(float dh, float g, float u, float* dg, float* du) {
  const float s = Sigmoid(g);
  *du = dh * g * s;
  *dg = dh * u * s * (1.f + g * (1.f - s));
}

__global__ void SwiGluBackwardKernel(const bf16* __restrict__ dh, const bf16* __restrict__ gate,
                                     const bf16* __restrict__ up, bf16* __restrict__ dgate, bf16* __restrict__ dup,
                                     int64_t n, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (int64_t i = first; i < n / 8; i += stride) {
      float dv[8], gv[8], uv[8], dg[8], du[8];
      Load8(dh + i * 8, dv);
      Load8(gate + i * 8, gv);
      Load8(up + i * 8, uv);
#pragma unroll
      for (int j = 0; j < 8; ++j) SwiGluGrad(dv[j], gv[j], uv[j], &dg[j], &du[j]);
      Store8(dgate + i * 8, dg);
      Store8(dup + i * 8, du);
    }
  }
  for (int64_t i = (vec ? n / 8 * 8 : 0) + first; i < n; i += stride) {
    float dg, du;
    SwiGluGrad(__bfloat162float(dh[i]), __bfloat162float(gate[i]), __bfloat162float(up[i]), &dg, &du);
    dgate[i] = __float2bfloat16_rn(dg);
    dup[i] = __float2bfloat16_rn(du);
  }
}

// One thread per rotated pair (i, i + D/2) of one head of one position.
__global__ void RopeKernel(const bf16* x, const bf16* __restrict__ cos, const bf16* __restrict__ sin, bf16* out,
                           int64_t pairs, int64_t Hh, int64_t D, bool inverse) {
  const int64_t half = D / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < pairs; t += stride) {
    const int64_t i = t % half, row = t / half, pos = row / Hh;  // row = (b, s, head), pos = (b, s)
    const bf16* c = cos + pos * D;
    const bf16* s = sin + pos * D;
    const float x1 = __bfloat162float(x[row * D + i]), x2 = __bfloat162float(x[row * D + i + half]);
    const float c1 = __bfloat162float(c[i]), c2 = __bfloat162float(c[i + half]);
    const float s1 = __bfloat162float(s[i]), s2 = __bfloat162float(s[i + half]);
    float o1, o2;
    if (!inverse) {
      o1 = x1 * c1 - x2 * s1;
      o2 = x2 * c2 + x1 * s2;
    } else {  // the transpose of [[c1, -s1], [s2, c2]]
      o1 = x1 * c1 + x2 * s2;
      o2 = x2 * c2 - x1 * s1;
    }
    out[row * D + i] = __float2bfloat16_rn(o1);
    out[row * D + i + half] = __float2bfloat16_rn(o2);
  }
}

struct AdamWScalars {
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bc2_sqrt;
};

__global__ void AdamWKernel(bf16* __restrict__ param, const void* __restrict__ grad, bool grad_fp32,
                            float* __restrict__ master, float* __restrict__ m, float* __restrict__ v,
                            const float* __restrict__ grad_scale, int64_t n, AdamWScalars a) {
  const float scale = grad_scale != nullptr ? *grad_scale : 1.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = (grad_fp32 ? static_cast<const float*>(grad)[i]
                               : __bfloat162float(static_cast<const bf16*>(grad)[i])) * scale;
    const float w = master[i] * a.decay;
    const float mi = m[i] + a.one_minus_beta1 * (g - m[i]);
    const float vi = v[i] * a.beta2 + a.one_minus_beta2 * g * g;
    const float denom = sqrtf(vi) / a.bc2_sqrt + a.eps;
    const float updated = w - a.step_size * (mi / denom);
    master[i] = updated;
    m[i] = mi;
    v[i] = vi;
    if (param != nullptr) param[i] = __float2bfloat16_rn(updated);
  }
}

int Multiprocessors() {
  static const int count = [] {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return std::max(1, sms);
  }();
  return count;
}

int NormThreads(int64_t H) {
  const int64_t vecs = H / 8;
  return static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(32, (vecs + 31) / 32 * 32)));
}
int NormChunks(int64_t H) { return static_cast<int>((H / 8 + NormThreads(H) - 1) / NormThreads(H)); }
// Blocks of the backward: enough to fill the machine, each looping over rows.
int NormBackwardBlocks(int64_t N, int64_t H) {
  const int per_sm = std::max(1, 2048 / NormThreads(H));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(N, static_cast<int64_t>(Multiprocessors()) * per_sm)));
}
int ElementwiseBlocks(int64_t work, int threads) {
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((work + threads - 1) / threads, static_cast<int64_t>(Multiprocessors()) * 16)));
}
bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int RmsNormForward(const void* x, const void* w, void* y, float* rstd, int64_t N, int64_t H, float eps, void* stream) {
  if (N == 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  const int threads = NormThreads(H);
  const auto* xp = static_cast<const bf16*>(x);
  const auto* wp = static_cast<const bf16*>(w);
  auto* yp = static_cast<bf16*>(y);
  const int h = static_cast<int>(H);
  switch (NormChunks(H)) {
    case 1: RmsNormForwardKernel<1><<<N, threads, 0, s>>>(xp, wp, yp, rstd, h, eps); break;
    case 2: RmsNormForwardKernel<2><<<N, threads, 0, s>>>(xp, wp, yp, rstd, h, eps); break;
    case 3: RmsNormForwardKernel<3><<<N, threads, 0, s>>>(xp, wp, yp, rstd, h, eps); break;
    default: RmsNormForwardKernel<4><<<N, threads, 0, s>>>(xp, wp, yp, rstd, h, eps); break;
  }
  return cudaGetLastError();
}

int64_t RmsNormBackwardScratch(int64_t N, int64_t H) { return static_cast<int64_t>(NormBackwardBlocks(N, H)) * H; }

int RmsNormBackward(const void* g, const void* x, const void* w, const float* rstd, void* dx, float* dw,
                    float* partial, int64_t N, int64_t H, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (N == 0) return cudaMemsetAsync(dw, 0, H * sizeof(float), s);
  const int threads = NormThreads(H), blocks = NormBackwardBlocks(N, H);
  const auto* gp = static_cast<const bf16*>(g);
  const auto* xp = static_cast<const bf16*>(x);
  const auto* wp = static_cast<const bf16*>(w);
  auto* dxp = static_cast<bf16*>(dx);
  const int h = static_cast<int>(H);
  switch (NormChunks(H)) {
    case 1: RmsNormBackwardKernel<1><<<blocks, threads, 0, s>>>(gp, xp, wp, rstd, dxp, partial, N, h); break;
    case 2: RmsNormBackwardKernel<2><<<blocks, threads, 0, s>>>(gp, xp, wp, rstd, dxp, partial, N, h); break;
    case 3: RmsNormBackwardKernel<3><<<blocks, threads, 0, s>>>(gp, xp, wp, rstd, dxp, partial, N, h); break;
    default: RmsNormBackwardKernel<4><<<blocks, threads, 0, s>>>(gp, xp, wp, rstd, dxp, partial, N, h); break;
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  ColumnSumKernel<<<(h + 255) / 256, 256, 0, s>>>(partial, dw, blocks, h);
  return cudaGetLastError();
}

int SwiGluForward(const void* gate, const void* up, void* h, int64_t n, void* stream) {
  if (n == 0) return cudaSuccess;
  const bool vec = Aligned16(gate) && Aligned16(up) && Aligned16(h);
  constexpr int kThreads = 256;
  SwiGluForwardKernel<<<ElementwiseBlocks(vec ? n / 8 + 1 : n, kThreads), kThreads, 0,
                        static_cast<cudaStream_t>(stream)>>>(static_cast<const bf16*>(gate),
                                                             static_cast<const bf16*>(up), static_cast<bf16*>(h), n,
                                                             vec);
  return cudaGetLastError();
}

int SwiGluBackward(const void* dh, const void* gate, const void* up, void* dgate, void* dup, int64_t n,
                   void* stream) {
  if (n == 0) return cudaSuccess;
  const bool vec = Aligned16(dh) && Aligned16(gate) && Aligned16(up) && Aligned16(dgate) && Aligned16(dup);
  constexpr int kThreads = 256;
  SwiGluBackwardKernel<<<ElementwiseBlocks(vec ? n / 8 + 1 : n, kThreads), kThreads, 0,
                         static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(dh), static_cast<const bf16*>(gate), static_cast<const bf16*>(up),
      static_cast<bf16*>(dgate), static_cast<bf16*>(dup), n, vec);
  return cudaGetLastError();
}

int Rope(const void* x, const void* cos, const void* sin, void* out, int64_t B, int64_t S, int64_t Hh, int64_t D,
         bool inverse, void* stream) {
  const int64_t pairs = B * S * Hh * (D / 2);
  if (pairs == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  RopeKernel<<<ElementwiseBlocks(pairs, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(x), static_cast<const bf16*>(cos), static_cast<const bf16*>(sin),
      static_cast<bf16*>(out), pairs, Hh, D, inverse);
  return cudaGetLastError();
}

int AdamW(void* param, const void* grad, bool grad_fp32, float* master, float* exp_avg, float* exp_avg_sq,
          const float* grad_scale, int64_t n, const AdamWArgs& args, void* stream) {
  if (n == 0) return cudaSuccess;
  // The scalars as the libtorch reference forms them: in double, then used in fp32.
  const double lr = args.lr;
  AdamWScalars a;
  a.decay = static_cast<float>(1.0 - lr * args.weight_decay);
  a.beta1 = static_cast<float>(args.beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - args.beta1);
  a.beta2 = static_cast<float>(args.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - args.beta2);
  a.eps = static_cast<float>(args.eps);
  a.step_size = static_cast<float>(lr / args.bias_correction1);
  a.bc2_sqrt = static_cast<float>(std::sqrt(args.bias_correction2));
  constexpr int kThreads = 256;
  AdamWKernel<<<ElementwiseBlocks(n, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<bf16*>(param), grad, grad_fp32, master, exp_avg, exp_avg_sq, grad_scale, n, a);
  return cudaGetLastError();
}

const char* ErrorString(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace odyssey::kernels::cuda
