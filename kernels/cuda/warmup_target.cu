// The dense warm-up's KL target, two passes over the keys (see warmup_target.h).
//
// A block of 4 warps owns 16 query rows x 128 keys of one batch row; warp w owns keys
// 32w .. 32w + 31 as 4 mma n-tiles of 8. Per KV head the block stages its 128 keys (bf16, rows
// padded to D + 8 elements so ldmatrix is conflict-free) and each warp takes its keys' B fragments
// into registers (8 k-steps x 4 n-tiles x 2: 64 registers a lane at D = 128); then each of the
// KV head's G query heads in turn: its 16 rows staged, S = Q K^T by mma.sync m16n8k16 (fp32
// accumulators), and the pass's per-element work on S's fragment (a lane holds rows g and g + 8,
// keys 2c and 2c + 1 of each n-tile, lane = 4g + c):
//   pass 1: a running (max, sum of exp) per row over the lane's visible keys, combined across the
//     4 lanes of a row by shuffles and across the 4 warps through shared memory: the tile's
//     log-sum-exp per (head, row);
//   pass 2: exp(scale s - lse) on the visible keys, summed over every head in registers; a pool's
//     4 keys are lanes c and c ^ 1, added by one shuffle at the end.
// Tiles that no row of the block reaches (keys past its last row) write -inf or 0 and return.
#include "kernels/cuda/warmup_target.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/mma.cuh"

namespace odyssey::kernels::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kD = 128;
constexpr int kRows = 16;     // query rows per block: one mma m-tile
constexpr int kKeys = 128;    // keys per block: 4 warps x 4 n-tiles x 8
constexpr int kThreads = 128;
constexpr int kLd = kD + mma::kPad;  // a staged row's stride, elements
constexpr int kSteps = kD / 16;      // mma k-steps over D
constexpr int kChunks = kD / 8;      // 16-byte chunks of a row

struct Tiles {
  bf16 k[kKeys * kLd];
  bf16 q[kRows * kLd];
};

// Keys [key0, key0 + 128) of KV head kvh, zeros from `kv` on (never visible from the block).
__device__ void StageKeys(bf16* dst, const WarmupTargetArgs& a, int64_t b, int64_t kvh, int64_t key0, int64_t kv) {
  const bf16* base = static_cast<const bf16*>(a.k) + b * a.k_sb + kvh * a.k_sh;
  for (int i = threadIdx.x; i < kKeys * kChunks; i += kThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    const int64_t key = key0 + row;
    const bool valid = key < kv;
    mma::CpAsync16(dst + row * kLd + chunk * 8, base + (valid ? key : 0) * a.k_ss + chunk * 8, valid);
  }
}

// Block rows [row0, row0 + 16) (of [0, n), at positions t0 + row) of query head h, zeros past n.
__device__ void StageQueries(bf16* dst, const WarmupTargetArgs& a, int64_t b, int64_t h, int64_t row0) {
  const bf16* base = static_cast<const bf16*>(a.q) + b * a.q_sb + h * a.q_sh;
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    const int64_t r = row0 + row;
    const bool valid = r < a.n;
    mma::CpAsync16(dst + row * kLd + chunk * 8, base + (a.t0 + (valid ? r : 0)) * a.q_ss + chunk * 8, valid);
  }
}

// acc[nt] = the staged rows times the warp's n-tile nt of keys (B fragments in b).
__device__ __forceinline__ void Scores(float (&acc)[4][4], const bf16* q, const uint32_t (&b)[4][kSteps][2],
                                       int lane) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    uint32_t af[4];
    mma::LoadA(af, q, kLd, ks * 16, lane);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) mma::Mma(acc[nt], af, b[nt][ks][0], b[nt][ks][1]);
  }
}

// KV head kvh's 128 keys staged and this warp's 32 of them taken as B fragments (after every
// reader of the previous head's tiles is done).
__device__ __forceinline__ void StageKvHead(Tiles& sm, uint32_t (&bf)[4][kSteps][2], const WarmupTargetArgs& a,
                                            int64_t b, int64_t kvh, int64_t key0, int warp, int lane) {
  __syncthreads();
  StageKeys(sm.k, a, b, kvh, key0, a.t0 + a.n);
  mma::CpAsyncWait();
  __syncthreads();
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) mma::LoadBAll<kD>(bf[nt], sm.k + (32 * warp + 8 * nt) * kLd, kLd, lane);
}

// Query head h's 16 rows staged (after the previous head's readers are done) and their scores
// against the warp's keys.
__device__ __forceinline__ void HeadScores(float (&acc)[4][4], Tiles& sm, const uint32_t (&bf)[4][kSteps][2],
                                           const WarmupTargetArgs& a, int64_t b, int64_t h, int64_t row0, int lane) {
  __syncthreads();
  StageQueries(sm.q, a, b, h, row0);
  mma::CpAsyncWait();
  __syncthreads();
  Scores(acc, sm.q, bf, lane);
}

// For each KV head's keys staged, each of its query heads' scores against the warp's keys:
// f(h, acc) per query head h, in head order.
template <typename F>
__device__ __forceinline__ void ForEachHeadScores(Tiles& sm, const WarmupTargetArgs& a, int64_t b, int64_t key0,
                                                  int64_t row0, int warp, int lane, F&& f) {
  const int64_t G = a.H / a.Hkv;
  for (int64_t kvh = 0; kvh < a.Hkv; ++kvh) {
    uint32_t bf[4][kSteps][2];
    StageKvHead(sm, bf, a, b, kvh, key0, warp, lane);
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t h = kvh * G + gi;
      float acc[4][4];
      HeadScores(acc, sm, bf, a, b, h, row0, lane);  // (its barrier: the previous head's readers are done)
      f(h, acc);
    }
  }
}

// (m, s) <- the log-sum-exp pair of both (m the max, s the sum of exp(x - m); m = -inf: empty).
__device__ __forceinline__ void Combine(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2, s = s2;
    return;
  }
  const float mx = fmaxf(m, m2);
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

// True when no key of the tile [key0, ...) is visible from any row of the block.
__device__ __forceinline__ bool PastTheRows(const WarmupTargetArgs& a, int64_t row0, int64_t key0) {
  const int64_t last = (row0 + kRows < a.n ? row0 + kRows : a.n) - 1;
  return key0 > a.t0 + last;
}

__global__ void __launch_bounds__(kThreads) LseKernel(WarmupTargetArgs a, float* part, int64_t tiles) {
  __shared__ __align__(16) Tiles sm;
  __shared__ float red_m[4][kRows], red_s[4][kRows];
  const int64_t kt = blockIdx.x, row0 = static_cast<int64_t>(blockIdx.y) * kRows, b = blockIdx.z;
  const int64_t key0 = kt * kKeys;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  if (PastTheRows(a, row0, key0)) {
    for (int64_t i = threadIdx.x; i < a.H * kRows; i += kThreads) {
      const int64_t h = i / kRows, r = row0 + i % kRows;
      if (r < a.n) part[((b * a.H + h) * a.n + r) * tiles + kt] = -INFINITY;
    }
    return;
  }
  // (HeadScores' barrier also orders the previous head's reductions, read below, before the
  // next head's writes.)
  ForEachHeadScores(sm, a, b, key0, row0, warp, lane, [&](int64_t h, const float (&acc)[4][4]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t r = row0 + g + 8 * i, t = a.t0 + r;
      const bool row_ok = r < a.n;
      float m = -INFINITY, s = 0.f;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int64_t key = key0 + 32 * warp + 8 * nt + 2 * c + j;
          if (row_ok && key <= t) m = fmaxf(m, acc[nt][2 * i + j] * a.scale);
        }
      }
      if (m != -INFINITY) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int64_t key = key0 + 32 * warp + 8 * nt + 2 * c + j;
            if (row_ok && key <= t) s += expf(acc[nt][2 * i + j] * a.scale - m);
          }
        }
      }
#pragma unroll
      for (int off = 1; off <= 2; off *= 2) {
        const float m2 = __shfl_xor_sync(mma::kFull, m, off), s2 = __shfl_xor_sync(mma::kFull, s, off);
        Combine(m, s, m2, s2);
      }
      if (c == 0) red_m[warp][g + 8 * i] = m, red_s[warp][g + 8 * i] = s;
    }
    __syncthreads();
    if (threadIdx.x < kRows) {
      float m = red_m[0][threadIdx.x], s = red_s[0][threadIdx.x];
      for (int w = 1; w < 4; ++w) Combine(m, s, red_m[w][threadIdx.x], red_s[w][threadIdx.x]);
      const int64_t r = row0 + threadIdx.x;
      if (r < a.n) part[((b * a.H + h) * a.n + r) * tiles + kt] = s > 0.f ? m + logf(s) : -INFINITY;
    }
  });
}

__global__ void __launch_bounds__(kThreads) PoolsKernel(WarmupTargetArgs a, const float* lse, float* out, int64_t pv) {
  __shared__ __align__(16) Tiles sm;
  const int64_t kt = blockIdx.x, row0 = static_cast<int64_t>(blockIdx.y) * kRows, b = blockIdx.z;
  const int64_t key0 = kt * kKeys, pool0 = key0 / 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  if (PastTheRows(a, row0, key0)) {  // every pool of the tile ends past every row: 0
    for (int64_t i = threadIdx.x; i < kRows * (kKeys / 4); i += kThreads) {
      const int64_t r = row0 + i / (kKeys / 4), p = pool0 + i % (kKeys / 4);
      if (r < a.n && p < pv) out[(b * a.n + r) * pv + p] = 0.f;
    }
    return;
  }
  float pacc[4][2] = {};  // per n-tile, rows g and g + 8: this lane's two keys, summed over heads
  ForEachHeadScores(sm, a, b, key0, row0, warp, lane, [&](int64_t h, const float (&acc)[4][4]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t r = row0 + g + 8 * i, t = a.t0 + r;
      const bool row_ok = r < a.n;
      const float l = row_ok ? lse[(b * a.H + h) * a.n + r] : 0.f;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int64_t key = key0 + 32 * warp + 8 * nt + 2 * c + j;
          if (row_ok && key <= t) pacc[nt][i] += expf(acc[nt][2 * i + j] * a.scale - l);
        }
      }
    }
  });
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float x = pacc[nt][i] + __shfl_xor_sync(mma::kFull, pacc[nt][i], 1);  // the pool's 4 keys
      const int64_t p = (key0 + 32 * warp + 8 * nt + 2 * c) / 4, r = row0 + g + 8 * i;
      if ((c & 1) == 0 && r < a.n && p < pv) out[(b * a.n + r) * pv + p] = 4 * p + 3 <= a.t0 + r ? x : 0.f;
    }
  }
}

}  // namespace

bool WarmupTargetSupported(int64_t B, int64_t H, int64_t Hkv, int64_t D) {
  return D == kD && Hkv > 0 && H % Hkv == 0 && B >= 1 && B <= 65535;
}

int64_t WarmupTargetKeyTiles(const WarmupTargetArgs& a) { return (a.t0 + a.n + kKeys - 1) / kKeys; }

int WarmupTargetLse(const WarmupTargetArgs& a, float* part, void* stream) {
  if (a.n <= 0 || a.B == 0) return cudaSuccess;
  const int64_t tiles = WarmupTargetKeyTiles(a);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>((a.n + kRows - 1) / kRows),
                  static_cast<unsigned>(a.B));
  LseKernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a, part, tiles);
  return cudaGetLastError();
}

int WarmupTargetPools(const WarmupTargetArgs& a, const float* lse, float* out, int64_t pv, void* stream) {
  if (a.n <= 0 || a.B == 0 || pv <= 0) return cudaSuccess;
  const int64_t tiles = (4 * pv + kKeys - 1) / kKeys;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>((a.n + kRows - 1) / kRows),
                  static_cast<unsigned>(a.B));
  PoolsKernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a, lse, out, pv);
  return cudaGetLastError();
}

}  // namespace odyssey::kernels::cuda
