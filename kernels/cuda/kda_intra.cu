// Chunked KDA's chunk-local quantities, whole-chunk Gram form (see kda_intra.h), fp32 on CUDA
// cores. One block of 512 threads per (batch x head, chunk), the chunk in shared memory, five
// phases:
//   A: element-wise (a warp's lanes on consecutive columns of a row: coalesced global access):
//      kp, km, qp into shared memory transposed (column d's C values contiguous), X and Y row
//      major; qg, kg, eGC (and the cache's factors) out.
//   B: the two Grams by 4 x 4 tiles, half the threads on Lkk = strict_lower(kp km^T), half on
//      Aqk = lower(qp km^T); a tile's rows and columns are one float4 each per column d (the
//      rows' a broadcast within the warp), tiles above the diagonal skipped.
//   C: T = (I + A_kk)^-1 by blocks of 16: each diagonal block inverted by forward substitution,
//      one thread per column (columns are independent: no barrier inside); then block row by
//      block row, T_ij = -T_ii sum_k A_ik T_kj as two small products.
//   D: W = T X, U = T Y by 4 x 4 tiles (T's rows as one float4 of its transpose).
#include "kernels/cuda/kda_intra.h"

#include <cuda_runtime.h>

namespace odyssey::kernels::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kB = 16;  // the inverse's block

struct Params {
  KdaIntraArgs a;
  KdaIntraCache c;
  bool cache;
};

// acc[x][y] += a[x] b[y]: one step of a 4 x 4 tile's product, a and b read as float4 from shared
// memory.
__device__ __forceinline__ void OuterAdd(float (&acc)[4][4], const float* a, const float* b) {
  const float4 u = *reinterpret_cast<const float4*>(a), w = *reinterpret_cast<const float4*>(b);
  const float av[4] = {u.x, u.y, u.z, u.w}, bv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int x = 0; x < 4; ++x) {
#pragma unroll
    for (int y = 0; y < 4; ++y) acc[x][y] = fmaf(av[x], bv[y], acc[x][y]);
  }
}

template <int C, int K>
struct Smem {
  static constexpr int kLdT = C + 4;   // transposed kp, km, qp: [K][C + 4] (16-byte rows)
  static constexpr int kLdX = K + 4;   // X: [C][K + 4]
  static constexpr int kLdA = C + 1;   // A_kk, T: [C][C + 1]
  static constexpr int kLdTT = C + 4;  // T transposed: [C][C + 4]
  static constexpr int kKp = 0, kKm = kKp + K * kLdT, kQp = kKm + K * kLdT, kX = kQp + K * kLdT;
  static constexpr int kY = kX + C * kLdX;  // Y: [C][ldy], ldy = V + 4 (V at run time)
  __host__ __device__ static int A(int V) { return kY + C * (V + 4); }
  __host__ __device__ static int T(int V) { return A(V) + C * kLdA; }
  __host__ __device__ static int TT(int V) { return T(V) + C * kLdA; }
  __host__ __device__ static int P(int V) { return TT(V) + C * kLdTT; }  // [kB][C] scratch of the block rows
  __host__ __device__ static int B(int V) { return P(V) + kB * C; }      // beta of the chunk's rows
  __host__ __device__ static int Floats(int V) { return B(V) + C; }
};

template <int C, int K>
__global__ void __launch_bounds__(kThreads) IntraKernel(Params p) {
  using L = Smem<C, K>;
  extern __shared__ __align__(16) float sm[];
  const KdaIntraArgs& a = p.a;
  const int V = static_cast<int>(a.V), ldy = V + 4;
  float* sKp = sm + L::kKp;
  float* sKm = sm + L::kKm;
  float* sQp = sm + L::kQp;
  float* sX = sm + L::kX;
  float* sY = sm + L::kY;
  float* sA = sm + L::A(V);
  float* sT = sm + L::T(V);
  float* sTT = sm + L::TT(V);
  float* sP = sm + L::P(V);
  float* sB = sm + L::B(V);

  const int64_t n = blockIdx.x, bh = blockIdx.y, b = bh / a.HV, h = bh % a.HV;
  const int64_t chunk = bh * a.N + n, t0 = n * C;
  const float* q = a.q + b * a.q_sb + h * a.q_sh;
  const float* k = a.k + b * a.k_sb + h * a.k_sh;
  const float* v = a.v + b * a.v_sb + h * a.v_sh;
  const float* beta = a.beta + b * a.b_sb + h * a.b_sh;
  const float* G = a.G + chunk * C * K;
  const int64_t ck = chunk * C * K, cv = chunk * C * V, cc = chunk * C * C;
  const int tid = threadIdx.x;

  for (int i = tid; i < C; i += kThreads) sB[i] = t0 + i < a.L ? beta[(t0 + i) * a.b_st] : 0.f;
  __syncthreads();
  // A: the element-wise factors. A thread's elements e = tid + s kThreads share their column d
  // (kThreads is a multiple of K), and the inputs of 4 of them are loaded before any is used:
  // the loads are in flight together instead of one element's at a time (the stores below may
  // alias the inputs as far as the compiler knows, so it would not hoist them itself).
  static_assert(kThreads % K == 0 && (C * K) % kThreads == 0, "a thread's elements share a column");
  constexpr int kPer = C * K / kThreads, kBatch = kPer < 4 ? kPer : 4;  // 4: no spills in any instance
  const float g0 = G[tid % K], gc = G[(C - 1) * K + tid % K];
  for (int s0 = 0; s0 < kPer; s0 += kBatch) {
    float gs[kBatch], ks[kBatch], qs[kBatch];
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      const int e = tid + (s0 + s) * kThreads, i = e / K, d = e % K;
      const int64_t t = t0 + i;
      const bool in = t < a.L;
      gs[s] = G[e];
      ks[s] = in ? k[t * a.k_st + d] : 0.f;
      qs[s] = in ? q[t * a.q_st + d] : 0.f;
    }
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      const int e = tid + (s0 + s) * kThreads, i = e / K, d = e % K;
      const float g = gs[s], kk = ks[s], qq = qs[s];
      const float ep = expf(g - g0), em = expf(g0 - g), eg = expf(g), ec = expf(gc - g);
      const float kp = kk * ep, km = kk * em, qp = qq * ep, x = sB[i] * kk * eg;
      sKp[d * L::kLdT + i] = kp;
      sKm[d * L::kLdT + i] = km;
      sQp[d * L::kLdT + i] = qp;
      sX[i * L::kLdX + d] = x;
      a.qg[ck + e] = qq * eg;
      a.kg[ck + e] = kk * ec;
      if (i == 0) a.eGC[chunk * K + d] = expf(gc);
      if (p.cache) {
        p.c.Ep[ck + e] = ep, p.c.Em[ck + e] = em, p.c.eG[ck + e] = eg, p.c.EC[ck + e] = ec;
        p.c.kp[ck + e] = kp, p.c.km[ck + e] = km, p.c.qp[ck + e] = qp, p.c.X[ck + e] = x;
      }
    }
  }
  for (int e = tid; e < C * V; e += kThreads) {
    const int i = e / V, d = e % V;
    const int64_t t = t0 + i;
    const float y = sB[i] * (t < a.L ? v[t * a.v_st + d] : 0.f);
    sY[i * ldy + d] = y;
    if (p.cache) p.c.Y[cv + e] = y;
  }
  __syncthreads();
  // B: 4 x 4 tiles of the two Grams; threads [0, tiles) on Lkk, [tiles, 2 tiles) on Aqk.
  {
    constexpr int kTiles = (C / 4) * (C / 4);
    static_assert(2 * kTiles <= kThreads, "one tile per thread");
    if (tid < 2 * kTiles) {
      const bool qk = tid >= kTiles;
      const int tile = qk ? tid - kTiles : tid, ti = tile / (C / 4), tj = tile % (C / 4);
      const int i0 = 4 * ti, j0 = 4 * tj;
      float acc[4][4] = {};
      if (tj <= ti) {
        const float* rows = qk ? sQp : sKp;
#pragma unroll 8
        for (int d = 0; d < K; ++d) OuterAdd(acc, rows + d * L::kLdT + i0, sKm + d * L::kLdT + j0);
      }
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int i = i0 + x;
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          const int j = j0 + y;
          if (qk) {
            a.Aqk[cc + i * C + j] = j <= i ? acc[x][y] : 0.f;
          } else {
            const float lk = j < i ? acc[x][y] : 0.f;
            if (p.cache) p.c.Lkk[cc + i * C + j] = lk;
            sA[i * L::kLdA + j] = lk * sB[i];
          }
        }
      }
    }
  }
  __syncthreads();
  // C: T = (I + A_kk)^-1. The diagonal blocks: thread c owns column c of its block.
  for (int c = tid; c < C; c += kThreads) {
    const int r0 = c / kB * kB;
    for (int i = r0; i < c; ++i) sT[i * L::kLdA + c] = 0.f;
    sT[c * L::kLdA + c] = 1.f;
    for (int i = c + 1; i < r0 + kB; ++i) {
      float s = 0.f;
      for (int j = c; j < i; ++j) s = fmaf(-sA[i * L::kLdA + j], sT[j * L::kLdA + c], s);
      sT[i * L::kLdA + c] = s;
    }
  }
  // Above the diagonal blocks: zeros.
  for (int e = tid; e < C * C; e += kThreads) {
    const int i = e / C, j = e % C;
    if (j / kB > i / kB) sT[i * L::kLdA + j] = 0.f;
  }
  __syncthreads();
  // Block row r (rows r0 .. r0 + 15) against the columns before it: P = A_r,<r T_<r,<r, then
  // T_r,<r = -T_rr P.
  for (int r0 = kB; r0 < C; r0 += kB) {
    for (int e = tid; e < kB * r0; e += kThreads) {
      const int i = e / r0, c = e % r0;
      float s = 0.f;
      for (int j = c; j < r0; ++j) s = fmaf(sA[(r0 + i) * L::kLdA + j], sT[j * L::kLdA + c], s);
      sP[i * C + c] = s;
    }
    __syncthreads();
    for (int e = tid; e < kB * r0; e += kThreads) {
      const int i = e / r0, c = e % r0;
      float s = 0.f;
      for (int m = 0; m <= i; ++m) s = fmaf(-sT[(r0 + i) * L::kLdA + r0 + m], sP[m * C + c], s);
      sT[(r0 + i) * L::kLdA + c] = s;
    }
    __syncthreads();
  }
  // T transposed for D's float4 reads of a row tile; the cache's T.
  for (int e = tid; e < C * C; e += kThreads) {
    const int i = e / C, j = e % C;
    const float t = sT[i * L::kLdA + j];
    sTT[j * L::kLdTT + i] = t;
    if (p.cache) p.c.T[cc + e] = t;
  }
  __syncthreads();
  // D: W = T X, U = T Y by 4 x 4 tiles (rows i0.., columns d0..); T is lower: j <= i0 + 3.
  auto product = [&](const float* src, int ld, int cols, float* dst) {
    const int tiles = (C / 4) * (cols / 4);
    for (int tile = tid; tile < tiles; tile += kThreads) {
      const int i0 = 4 * (tile / (cols / 4)), d0 = 4 * (tile % (cols / 4));
      float acc[4][4] = {};
      for (int j = 0; j < i0 + 4; ++j) OuterAdd(acc, sTT + j * L::kLdTT + i0, src + j * ld + d0);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        *reinterpret_cast<float4*>(dst + static_cast<int64_t>(i0 + r) * cols + d0) =
            make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      }
    }
  };
  product(sX, L::kLdX, K, a.W + ck);
  product(sY, ldy, V, a.U + cv);
}

template <int C, int K>
int Launch(const Params& p, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(Smem<C, K>::Floats(static_cast<int>(p.a.V))) * sizeof(float);
  // Above 48 KB of dynamic shared memory a kernel has to opt in (sm_90 allows 227 KB).
  const cudaError_t e =
      cudaFuncSetAttribute(&IntraKernel<C, K>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  const dim3 grid(static_cast<unsigned>(p.a.N), static_cast<unsigned>(p.a.B * p.a.HV));
  IntraKernel<C, K><<<grid, kThreads, bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool KdaIntraSupported(int64_t C, int64_t K, int64_t V) {
  return (C == 32 || C == 64) && (K == 32 || K == 64 || K == 128) && V >= 4 && V <= 128 && V % 4 == 0;
}

int KdaIntraForward(const KdaIntraArgs& a, void* stream) {
  if (!KdaIntraSupported(a.C, a.K, a.V) || a.N <= 0 || a.B <= 0 || a.HV <= 0 || a.B * a.HV > 65535 ||
      a.N > 2147483647 || a.L > a.N * a.C) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const Params p{a, a.cache != nullptr ? *a.cache : KdaIntraCache{}, a.cache != nullptr};
  const auto s = static_cast<cudaStream_t>(stream);
  return ByChunkAndKey(a.C, a.K, [&](auto c, auto k) { return Launch<decltype(c)::value, decltype(k)::value>(p, s); });
}

}  // namespace odyssey::kernels::cuda
