// The sequential state scans of chunked KDA (see kda_scan.h), fp32 on CUDA cores.
//
// One block of 256 threads owns the state columns v0..v0+31 of one (batch, head): the state
// slice (K x 32 fp32) stays in shared memory for the whole sequence, and the chunk's operands
// (C x K tiles of W, qg, kg, the C x C Aqk) stream through two staging buffers with cp.async, the
// next tile in flight while the current one is used. Per chunk the block does the few small
// matmuls of one scan step; thread (ty, tx) computes 4 adjacent columns (one float4) of rows
// ty, ty + 32, ... of each (C x 32) or (K x 32) product, so every shared read is either a
// broadcast or conflict-free (tiles have a row stride of K + 4 floats: 16-byte rows, skewed 4
// banks apart).
#include "kernels/cuda/kda_scan.h"

#include "kernels/cuda/kda_scan_common.cuh"

#include <cuda_pipeline.h>
#include <cuda_runtime.h>

namespace odyssey::kernels::cuda {
namespace {

using kda_scan::kBV;
using kda_scan::kThreads;
using kda_scan::Launch;
using kda_scan::PipelineStep;
using kda_scan::Stage;
constexpr int kTX = kBV / 4;         // threads across the columns, 4 (one float4) each
constexpr int kTY = kThreads / kTX;  // thread rows

template <int C, int K>
struct Layout {
  static constexpr int kWide = K > C ? K : C;
  static constexpr int kLd = kWide + 4;  // row stride of a staged tile
  static constexpr int kTile = C * kLd;  // floats per staging buffer
  static constexpr int kRC = C / kTY;    // rows of a (C x 32) product per thread
  static constexpr int kRK = K / kTY;    // rows of a (K x 32) product per thread
  // Two staging buffers, the state slice (K x 32), a (C x 32) slice of vt or dvt, one of dO.
  static constexpr int kFloats = 2 * kTile + K * kBV + 2 * C * kBV;
  static_assert(C % kTY == 0 && K % kTY == 0, "C and K must be multiples of 32");
};

__device__ __forceinline__ float4 Ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void St4(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void Fma4(float (&acc)[4], float a, const float4& b) {
  acc[0] += a * b.x;
  acc[1] += a * b.y;
  acc[2] += a * b.z;
  acc[3] += a * b.w;
}

// Copies a (K x 32) shared slice (row stride 32) to global rows of stride V, or back.
template <int K>
__device__ __forceinline__ void SliceToGlobal(float* dst, int64_t V, const float* src) {
  for (int i = threadIdx.x; i < K * kTX; i += kThreads) {
    const int r = i / kTX, c = (i % kTX) * 4;
    *reinterpret_cast<float4*>(dst + r * V + c) = Ld4(src + r * kBV + c);
  }
}
template <int K>
__device__ __forceinline__ void SliceFromGlobal(float* dst, const float* src, int64_t V) {
  for (int i = threadIdx.x; i < K * kTX; i += kThreads) {
    const int r = i / kTX, c = (i % kTX) * 4;
    *reinterpret_cast<float4*>(dst + r * kBV + c) =
        src != nullptr ? Ld4(src + r * V + c) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// Phases of one chunk: W (vt), [qg (o from the state), Aqk (o from vt),] kg (the update).
template <int C, int K, bool kOut>
__global__ void __launch_bounds__(kThreads) ScanForwardKernel(KdaScanForwardArgs a) {
  using L = Layout<C, K>;
  extern __shared__ float4 shared4[];
  float* const sh = reinterpret_cast<float*>(shared4);
  float* const S = sh + 2 * L::kTile;  // (K x 32) the state's columns
  float* const vts = S + K * kBV;      // (C x 32)
  const int tx = threadIdx.x % kTX, ty = threadIdx.x / kTX, col = tx * 4;
  const int64_t bh = blockIdx.y, N = a.N, V = a.V, v0 = static_cast<int64_t>(blockIdx.x) * kBV;
  const float* W = a.W + bh * N * C * K;
  const float* kg = a.kg + bh * N * C * K;
  const float* qg = kOut ? a.qg + bh * N * C * K : nullptr;
  const float* Aqk = kOut ? a.Aqk + bh * N * C * C : nullptr;
  const float* U = a.U + bh * N * C * V + v0;
  const float* eGC = a.eGC + bh * N * K;
  constexpr int kPhases = kOut ? 4 : 2;
  auto issue = [&](int64_t j) {
    const int64_t c = j / kPhases;
    const int p = static_cast<int>(j % kPhases);
    float* dst = sh + (j & 1) * L::kTile;
    if (p == 0) Stage(dst, L::kLd, W + c * C * K, C, K, K);
    else if (p == kPhases - 1) Stage(dst, L::kLd, kg + c * C * K, C, K, K);
    else if (p == 1) Stage(dst, L::kLd, qg + c * C * K, C, K, K);
    else Stage(dst, L::kLd, Aqk + c * C * C, C, C, C);
    __pipeline_commit();
  };
  SliceFromGlobal<K>(S, a.h0 != nullptr ? a.h0 + bh * K * V + v0 : nullptr, V);
  float u[L::kRC][4], un[L::kRC][4], out[L::kRC][4], eg[L::kRK];
#pragma unroll
  for (int i = 0; i < L::kRC; ++i) {
    const float4 x = Ld4(U + (ty + i * kTY) * V + col);
    u[i][0] = x.x, u[i][1] = x.y, u[i][2] = x.z, u[i][3] = x.w;
  }
  issue(0);
  const int64_t total = N * kPhases;
  for (int64_t c = 0; c < N; ++c) {
#pragma unroll
    for (int p = 0; p < kPhases; ++p) {
      const int64_t j = c * kPhases + p;
      PipelineStep(j, total, issue);
      const float* t = sh + (j & 1) * L::kTile;
      if (p == 0) {
        if (a.states != nullptr) SliceToGlobal<K>(a.states + (bh * N + c) * K * V + v0, V, S);
#pragma unroll
        for (int i = 0; i < L::kRK; ++i) eg[i] = eGC[c * K + ty + i * kTY];
        if (c + 1 < N) {
#pragma unroll
          for (int i = 0; i < L::kRC; ++i) {
            const float4 x = Ld4(U + ((c + 1) * C + ty + i * kTY) * V + col);
            un[i][0] = x.x, un[i][1] = x.y, un[i][2] = x.z, un[i][3] = x.w;
          }
        }
        float acc[L::kRC][4];
#pragma unroll
        for (int i = 0; i < L::kRC; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
#pragma unroll 8
        for (int k = 0; k < K; ++k) {
          const float4 s = Ld4(S + k * kBV + col);
#pragma unroll
          for (int i = 0; i < L::kRC; ++i) Fma4(acc[i], t[(ty + i * kTY) * L::kLd + k], s);
        }
#pragma unroll
        for (int i = 0; i < L::kRC; ++i) {
          const int r = ty + i * kTY;
          float x[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) x[e] = u[i][e] - acc[i][e];
          St4(vts + r * kBV + col, x);
          if (a.vt != nullptr) St4(a.vt + ((bh * N + c) * C + r) * V + v0 + col, x);
        }
      } else if (p == kPhases - 1) {
        float s[L::kRK][4];
#pragma unroll
        for (int i = 0; i < L::kRK; ++i) {
          const float4 x = Ld4(S + (ty + i * kTY) * kBV + col);
          s[i][0] = eg[i] * x.x, s[i][1] = eg[i] * x.y, s[i][2] = eg[i] * x.z, s[i][3] = eg[i] * x.w;
        }
#pragma unroll 8
        for (int r = 0; r < C; ++r) {
          const float4 x = Ld4(vts + r * kBV + col);
#pragma unroll
          for (int i = 0; i < L::kRK; ++i) Fma4(s[i], t[r * L::kLd + ty + i * kTY], x);
        }
#pragma unroll
        for (int i = 0; i < L::kRK; ++i) St4(S + (ty + i * kTY) * kBV + col, s[i]);
#pragma unroll
        for (int i = 0; i < L::kRC; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) u[i][e] = un[i][e];
      } else if (p == 1) {
#pragma unroll
        for (int i = 0; i < L::kRC; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) out[i][e] = 0.f;
#pragma unroll 8
        for (int k = 0; k < K; ++k) {
          const float4 s = Ld4(S + k * kBV + col);
#pragma unroll
          for (int i = 0; i < L::kRC; ++i) Fma4(out[i], t[(ty + i * kTY) * L::kLd + k], s);
        }
      } else {
#pragma unroll 8
        for (int r = 0; r < C; ++r) {
          const float4 x = Ld4(vts + r * kBV + col);
#pragma unroll
          for (int i = 0; i < L::kRC; ++i) Fma4(out[i], t[(ty + i * kTY) * L::kLd + r], x);
        }
#pragma unroll
        for (int i = 0; i < L::kRC; ++i) St4(a.o + ((bh * N + c) * C + ty + i * kTY) * V + v0 + col, out[i]);
      }
      __syncthreads();
    }
  }
  SliceToGlobal<K>(a.hN + bh * K * V + v0, V, S);
}

// Phases of one chunk, c from N - 1 down: kg and the dO slice (dvt), qg (dO's part of the
// state gradient), W (dvt's part).
template <int C, int K>
__global__ void __launch_bounds__(kThreads) ScanBackwardKernel(KdaScanBackwardArgs a) {
  using L = Layout<C, K>;
  extern __shared__ float4 shared4[];
  float* const sh = reinterpret_cast<float*>(shared4);
  float* const dS = sh + 2 * L::kTile;  // (K x 32) the gradient of the state after chunk c
  float* const dvts = dS + K * kBV;     // (C x 32)
  float* const dOs = dvts + C * kBV;    // (C x 32)
  const int tx = threadIdx.x % kTX, ty = threadIdx.x / kTX, col = tx * 4;
  const int64_t bh = blockIdx.y, N = a.N, V = a.V, v0 = static_cast<int64_t>(blockIdx.x) * kBV;
  const float* W = a.W + bh * N * C * K;
  const float* kg = a.kg + bh * N * C * K;
  const float* qg = a.qg + bh * N * C * K;
  const float* dO = a.dO + bh * N * C * V + v0;
  const float* P = a.P + bh * N * C * V + v0;
  const float* eGC = a.eGC + bh * N * K;
  constexpr int kPhases = 3;
  auto issue = [&](int64_t j) {
    const int64_t c = N - 1 - j / kPhases;
    const int p = static_cast<int>(j % kPhases);
    float* dst = sh + (j & 1) * L::kTile;
    if (p == 0) {
      Stage(dst, L::kLd, kg + c * C * K, C, K, K);
      Stage(dOs, kBV, dO + c * C * V, C, kBV, V);
    } else if (p == 1) {
      Stage(dst, L::kLd, qg + c * C * K, C, K, K);
    } else {
      Stage(dst, L::kLd, W + c * C * K, C, K, K);
    }
    __pipeline_commit();
  };
  SliceFromGlobal<K>(dS, a.dSN != nullptr ? a.dSN + bh * K * V + v0 : nullptr, V);
  float pr[L::kRC][4], pn[L::kRC][4], ds[L::kRK][4], eg[L::kRK];
#pragma unroll
  for (int i = 0; i < L::kRC; ++i) {
    const float4 x = Ld4(P + ((N - 1) * C + ty + i * kTY) * V + col);
    pr[i][0] = x.x, pr[i][1] = x.y, pr[i][2] = x.z, pr[i][3] = x.w;
  }
  issue(0);
  const int64_t total = N * kPhases;
  for (int64_t step = 0; step < N; ++step) {
    const int64_t c = N - 1 - step;
#pragma unroll
    for (int p = 0; p < kPhases; ++p) {
      const int64_t j = step * kPhases + p;
      PipelineStep(j, total, issue);
      const float* t = sh + (j & 1) * L::kTile;
      if (p == 0) {
        SliceToGlobal<K>(a.dS + (bh * N + c) * K * V + v0, V, dS);
#pragma unroll
        for (int i = 0; i < L::kRK; ++i) eg[i] = eGC[c * K + ty + i * kTY];
        if (c > 0) {
#pragma unroll
          for (int i = 0; i < L::kRC; ++i) {
            const float4 x = Ld4(P + ((c - 1) * C + ty + i * kTY) * V + col);
            pn[i][0] = x.x, pn[i][1] = x.y, pn[i][2] = x.z, pn[i][3] = x.w;
          }
        }
#pragma unroll 8
        for (int k = 0; k < K; ++k) {
          const float4 s = Ld4(dS + k * kBV + col);
#pragma unroll
          for (int i = 0; i < L::kRC; ++i) Fma4(pr[i], t[(ty + i * kTY) * L::kLd + k], s);
        }
#pragma unroll
        for (int i = 0; i < L::kRC; ++i) {
          const int r = ty + i * kTY;
          St4(dvts + r * kBV + col, pr[i]);
          St4(a.dvt + ((bh * N + c) * C + r) * V + v0 + col, pr[i]);
        }
      } else if (p == 1) {
#pragma unroll
        for (int i = 0; i < L::kRK; ++i) {
          const float4 x = Ld4(dS + (ty + i * kTY) * kBV + col);
          ds[i][0] = eg[i] * x.x, ds[i][1] = eg[i] * x.y, ds[i][2] = eg[i] * x.z, ds[i][3] = eg[i] * x.w;
        }
#pragma unroll 8
        for (int r = 0; r < C; ++r) {
          const float4 x = Ld4(dOs + r * kBV + col);
#pragma unroll
          for (int i = 0; i < L::kRK; ++i) Fma4(ds[i], t[r * L::kLd + ty + i * kTY], x);
        }
      } else {
#pragma unroll 8
        for (int r = 0; r < C; ++r) {
          const float4 x = Ld4(dvts + r * kBV + col);
          const float4 nx = make_float4(-x.x, -x.y, -x.z, -x.w);
#pragma unroll
          for (int i = 0; i < L::kRK; ++i) Fma4(ds[i], t[r * L::kLd + ty + i * kTY], nx);
        }
#pragma unroll
        for (int i = 0; i < L::kRK; ++i) St4(dS + (ty + i * kTY) * kBV + col, ds[i]);
#pragma unroll
        for (int i = 0; i < L::kRC; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) pr[i][e] = pn[i][e];
      }
      __syncthreads();
    }
  }
  SliceToGlobal<K>(a.dS0 + bh * K * V + v0, V, dS);
}

template <int C, int K>
int Forward(const KdaScanForwardArgs& a, cudaStream_t stream) {
  const size_t bytes = Layout<C, K>::kFloats * sizeof(float);
  return a.qg != nullptr ? Launch(&ScanForwardKernel<C, K, true>, a, bytes, stream)
                         : Launch(&ScanForwardKernel<C, K, false>, a, bytes, stream);
}

template <int C, int K>
int Backward(const KdaScanBackwardArgs& a, cudaStream_t stream) {
  return Launch(&ScanBackwardKernel<C, K>, a, Layout<C, K>::kFloats * sizeof(float), stream);
}

// The supported (C, K) instances.
#define ODYSSEY_KDA_DISPATCH(FN, C_, K_, ...)                       \
  do {                                                             \
    if ((C_) == 64 && (K_) == 128) return FN<64, 128>(__VA_ARGS__); \
    if ((C_) == 64 && (K_) == 64) return FN<64, 64>(__VA_ARGS__);   \
    if ((C_) == 64 && (K_) == 32) return FN<64, 32>(__VA_ARGS__);   \
    if ((C_) == 32 && (K_) == 128) return FN<32, 128>(__VA_ARGS__); \
    if ((C_) == 32 && (K_) == 64) return FN<32, 64>(__VA_ARGS__);   \
    if ((C_) == 32 && (K_) == 32) return FN<32, 32>(__VA_ARGS__);   \
    return static_cast<int>(cudaErrorInvalidValue);                \
  } while (false)

}  // namespace

bool KdaScanSupported(int64_t C, int64_t K, int64_t V) {
  return (C == 32 || C == 64) && (K == 32 || K == 64 || K == 128) && V > 0 && V % kBV == 0;
}

bool KdaScanBf16OperandsSupported(int64_t C, int64_t K, int64_t V, int value_block) {
  return KdaScanSupported(C, K, V) && (value_block == 32 || (value_block == 16 && C == 64 && K >= 64));
}

int KdaScanForward(const KdaScanForwardArgs& a, void* stream) {
  // An output (qg and Aqk set) goes to exactly one of o and o_rows; o_rows on the tensor cores.
  const bool out = a.qg != nullptr;
  if (!KdaScanSupported(a.C, a.K, a.V) || a.N <= 0 || a.BH <= 0 || a.BH > 65535 || out != (a.Aqk != nullptr) ||
      (out ? (a.o == nullptr) == (a.o_rows == nullptr) : a.o != nullptr || a.o_rows != nullptr) ||
      (a.o_rows != nullptr && (!a.tf32 || a.o_len < 0 || a.o_len > a.N * a.C))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  // bf16 operands: the tensor-core kernel, at a value block it has (16 only with an output).
  if (a.bf16_operands ? !a.tf32 || !KdaScanBf16OperandsSupported(a.C, a.K, a.V, a.value_block) ||
                            (!out && a.value_block != 32)
                      : a.value_block != 32) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (a.tf32) return KdaScanForwardTf32(a, stream);
  ODYSSEY_KDA_DISPATCH(Forward, a.C, a.K, a, static_cast<cudaStream_t>(stream));
}

int KdaScanBackward(const KdaScanBackwardArgs& a, void* stream) {
  if (!KdaScanSupported(a.C, a.K, a.V) || a.N <= 0 || a.BH <= 0 || a.BH > 65535 ||
      (a.tf32 ? a.Aqk == nullptr : a.P == nullptr) || (a.bf16_operands && !a.tf32)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (a.tf32) return KdaScanBackwardTf32(a, stream);
  ODYSSEY_KDA_DISPATCH(Backward, a.C, a.K, a, static_cast<cudaStream_t>(stream));
}

}  // namespace odyssey::kernels::cuda
