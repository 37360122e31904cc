// Chunked KDA's chunk-local quantities, whole-chunk Gram form (see kda_intra.h), fp32 on CUDA
// cores. One block of 512 threads per (batch x head, chunk), the chunk in shared memory, two blocks
// to a multiprocessor (shared memory ~105 KB a block at C = 64, K = V = 128; 64 registers a
// thread): one block's barriers and serial steps (the inverse) overlap the other's loads. Phases:
//   A: element-wise over one slice of KS = min(K, 64) key columns at a time, 4 consecutive
//      columns of a row a thread (vector loads of G, q, k and stores of qg, kg; a warp 8 rows x 16
//      columns): kp, km, qp of the slice into shared memory transposed (column d's C values
//      contiguous); qg, kg, eGC (and the cache's factors) out.
//   B: the two Grams by 4 x 4 tiles, half the threads on Lkk = strict_lower(kp km^T), half on
//      Aqk = lower(qp km^T), each tile's sums in registers across the slices; a tile's rows and
//      columns are one float4 each per column d (the rows' a broadcast within the warp), tiles
//      above the diagonal skipped. A and B alternate until every slice is in.
//   X: X = beta k exp(G) and Y = beta v row-major into the region the slices used.
//   C: T = (I + A_kk)^-1 by blocks of 16: each diagonal block inverted by forward substitution,
//      one thread per column (columns are independent: no barrier inside); then block row by
//      block row, T_ij = -T_ii sum_k A_ik T_kj as two small products.
//   D: W = T X, U = T Y by 4 x 4 tiles (a tile's 4 rows of T read as scalars: the warp's lanes
//      share them, a broadcast).
// With `tf32` (KdaIntraArgs; V a multiple of 8) B and D run on the tensor cores instead: 16 x 8
// warp tiles of mma.sync m16n8k8 (kda_bwd::WarpTile, TF32 operands, fp32 sums), a warp's Gram
// tiles summed in its registers across the slices; A_kk and T then have rows of C + 4 (the
// fragments' rows in distinct banks). The factors, X, Y and the inverse are the same code, except
// that the tensor-core form stores kp, km, qp, X and Y already rounded to TF32 (once each, where
// every fragment load rounded them before: the same sums, bit for bit) and takes exp by ex2.approx
// (Exp). Those two and the vector loads cut the instructions a block issues by a quarter (ncu at
// 32K tokens: 1.62 G -> 1.20 G, 2.56 -> 2.18 ms).
// Before the slices (one block a multiprocessor, 227 KB) the kernel held all of kp, km, qp, X, Y
// and T's transpose at once: 25% occupancy, latency-bound (ncu at 32K tokens: 3.75 ms, 910 GB/s,
// 9 cycles a warp between issues).
#include "kernels/cuda/kda_intra.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/cuda/kda_intra_backward_body.h"  // WarpTile, FragRow, FragCol: the tensor-core tiles

namespace odyssey::kernels::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kB = 16;  // the inverse's block

struct Params {
  KdaIntraArgs a;
  KdaIntraCache c;
  bool cache;
  bool vec;  // q, k and v take 4-element vector loads (Load4): base and strides aligned to them
};

// exp(x): in the tensor-core form (kFast) ex2.approx of x log2(e) (two instructions; relative
// error ~1e-6 where |x| <= 60, the whole-chunk form's bound, against the TF32 operands' 5e-4),
// else the full-precision expf (about nine).
template <bool kFast>
__device__ __forceinline__ float Exp(float x) {
  if constexpr (kFast) {
    return __expf(x);
  } else {
    return expf(x);
  }
}

// Elements i .. i + 3 of an input row (i a multiple of 4): one 8-byte (bf16) or 16-byte (fp32)
// load where `vec`, else four.
template <bool kIn16>
__device__ __forceinline__ float4 Load4(const void* p, int64_t i, bool vec) {
  if (vec) {
    if constexpr (kIn16) {
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + i);
      return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                         __uint_as_float(u.y & 0xffff0000u));
    } else {
      return *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    }
  }
  return make_float4(KdaLoadAs<kIn16>(p, i), KdaLoadAs<kIn16>(p, i + 1), KdaLoadAs<kIn16>(p, i + 2),
                     KdaLoadAs<kIn16>(p, i + 3));
}

// Two bf16 rounded to nearest even (libtorch's casts' rounding, KdaStore's), as one 32-bit word.
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
// Elements i .. i + 3 of a contiguous output (i a multiple of 4, the base 16-byte aligned): one
// store, bf16 or fp32.
__device__ __forceinline__ void Store4(void* p, bool bf16, int64_t i, float4 v) {
  if (bf16) {
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p) + i) = make_uint2(PackBf16(v.x, v.y), PackBf16(v.z, v.w));
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(p) + i) = v;
  }
}

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

template <int C, int K, bool kTc>
struct Smem {
  static constexpr int KS = K < 64 ? K : 64;  // key columns a slice
  static constexpr int kLdT = C + 4;          // transposed kp, km, qp of a slice: [KS][C + 4] (16-byte rows)
  static constexpr int kLdX = K + 4;          // X: [C][K + 4]
  // A_kk, T: [C][C + 1] (odd: the 4 x 4 tiles walk T's rows by columns), [C][C + 4] for the
  // tensor-core tiles (an mma fragment's 8 rows x 4 columns in distinct banks).
  static constexpr int kLdA = kTc ? C + 4 : C + 1;
  // The region of the slices (A, B), then of X and Y (X, D).
  static constexpr int kKp = 0, kKm = kKp + KS * kLdT, kQp = kKm + KS * kLdT, kSlices = kQp + KS * kLdT;
  static constexpr int kX = 0, kY = kX + C * kLdX;  // Y: [C][ldy], ldy = V + 4 (V at run time)
  __host__ __device__ static int Region(int V) {
    const int xy = kY + C * (V + 4);
    return xy > kSlices ? xy : kSlices;
  }
  __host__ __device__ static int A(int V) { return Region(V); }
  __host__ __device__ static int T(int V) { return A(V) + C * kLdA; }
  __host__ __device__ static int P(int V) { return T(V) + C * kLdA; }  // [kB][C] scratch of the block rows
  __host__ __device__ static int B(int V) { return P(V) + kB * C; }    // beta of the chunk's rows
  __host__ __device__ static int Floats(int V) { return B(V) + C; }
};

// kIn16: q, k, v bf16 (else fp32), fixed at compile time (no branch in the loads).
template <int C, int K, bool kTc, bool kIn16>
__global__ void __launch_bounds__(kThreads, 2) IntraKernel(Params p) {
  using L = Smem<C, K, kTc>;
  constexpr int KS = L::KS;
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
  float* sP = sm + L::P(V);
  float* sB = sm + L::B(V);

  const int64_t n = blockIdx.x, bh = blockIdx.y, b = bh / a.HV, h = bh % a.HV;
  const int64_t chunk = bh * a.N + n, t0 = n * C;
  // The inputs, fp32 or bf16 (kIn16; beta by its own bit), the block's (batch, head): token t's
  // element d at t * stride + d (Load4; q scaled as read).
  using In = std::conditional_t<kIn16, uint16_t, float>;
  const In* qp = static_cast<const In*>(a.q) + b * a.q_sb + h * a.q_sh;
  const In* kp = static_cast<const In*>(a.k) + b * a.k_sb + h * a.k_sh;
  const In* vp = static_cast<const In*>(a.v) + b * a.v_sb + h * a.v_sh;
  const int64_t bo = b * a.b_sb + h * a.b_sh;
  const bool b16 = a.bf16 & kKdaBf16Beta;
  const float* G = a.G + chunk * C * K;
  const int64_t ck = chunk * C * K, cv = chunk * C * V, cc = chunk * C * C;
  const int tid = threadIdx.x;

  for (int i = tid; i < C; i += kThreads) sB[i] = t0 + i < a.L ? KdaLoad(a.beta, b16, bo + (t0 + i) * a.b_st) : 0.f;
  __syncthreads();

  // The Gram tiles: threads [0, tiles) on Lkk, [tiles, 2 tiles) on Aqk; sums across the slices.
  constexpr int kTiles = (C / 4) * (C / 4);
  static_assert(2 * kTiles <= kThreads, "one tile per thread");
  const bool gram = tid < 2 * kTiles, qk = tid >= kTiles;
  const int tile = qk ? tid - kTiles : tid, ti = tile / (C / 4), tj = tile % (C / 4);
  const int i0 = 4 * ti, j0 = 4 * tj;
  float acc[4][4] = {};
  // kTc: the Grams by 16 x 8 warp tiles on the tensor cores (kda_bwd::WarpTile: TF32 operands,
  // fp32 sums); warp w owns tiles w, w + 16, ... of the (C / 16) x (C / 8) grid of each Gram
  // (Lkk's first, then Aqk's), kPerWarp of them, their sums in registers across the slices.
  constexpr int kWarps = kThreads / 32, kGramTiles = (C / 16) * (C / 8);
  constexpr int kPerWarp = (2 * kGramTiles + kWarps - 1) / kWarps;
  const int lane = tid % 32, warp = tid / 32;
  float tacc[kPerWarp][4] = {};

  // A thread takes 4 consecutive columns of one row at a time: one vector load of G, k and q each,
  // one store of qg and kg each. A warp covers 8 rows x 16 columns (a bf16 row's 16 columns are
  // one 32-byte sector); the 2 groups of a thread share their columns (rows 32 apart), so the
  // columns' G_0 and G_C are loaded once. A group at a time (loading both groups' inputs first
  // spilled: the Gram accumulators stay live through this phase). The transposed stores into the
  // slices meet 2-way bank conflicts.
  constexpr int kGroups = C * KS / 4, kIter = kGroups > kThreads ? kGroups / kThreads : 1;
  static_assert(kGroups % 32 == 0 && (kGroups <= kThreads || kGroups % kThreads == 0) && K % KS == 0 &&
                    (KS / 16) * (C / 8) * 32 == kGroups,
                "a warp's 8 x 16 tile of a slice");
  const int wt = tid / 32, at_col = 16 * (wt % (KS / 16)) + 4 * (lane % 4);
  const bool a_on = tid < kGroups;
  for (int d0 = 0; d0 < K; d0 += KS) {
    const int dl = at_col, d = d0 + dl;
    if (a_on) {
      const float4 g04 = *reinterpret_cast<const float4*>(G + d), gc4 = *reinterpret_cast<const float4*>(G + (C - 1) * K + d);
#pragma unroll 1
      for (int s = 0; s < kIter; ++s) {
        const int i = 8 * ((tid + s * kThreads) / 32 / (KS / 16)) + lane / 4;
        const int64_t t = t0 + i;
        const bool in = t < a.L;
        const float4 g4 = *reinterpret_cast<const float4*>(G + i * K + d);
        const float4 k4 = in ? Load4<kIn16>(kp, t * a.k_st + d, p.vec) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 q4 = in ? Load4<kIn16>(qp, t * a.q_st + d, p.vec) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float gv[4] = {g4.x, g4.y, g4.z, g4.w}, g0v[4] = {g04.x, g04.y, g04.z, g04.w},
                    gcv[4] = {gc4.x, gc4.y, gc4.z, gc4.w}, kv[4] = {k4.x, k4.y, k4.z, k4.w},
                    qv[4] = {q4.x * a.q_scale, q4.y * a.q_scale, q4.z * a.q_scale, q4.w * a.q_scale};
        float qgv[4], kgv[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const float g = gv[x], g0 = g0v[x], kk = kv[x], qq = qv[x];
          const float ep = Exp<kTc>(g - g0), em = Exp<kTc>(g0 - g), eg = Exp<kTc>(g), ec = Exp<kTc>(gcv[x] - g);
          const float kpx = kk * ep, kmx = kk * em, qpx = qq * ep;
          // The tensor-core Grams read these as TF32: rounded once here (WarpTile's kARounded).
          sKp[(dl + x) * L::kLdT + i] = kTc ? mma::Tf32Rounded(kpx) : kpx;
          sKm[(dl + x) * L::kLdT + i] = kTc ? mma::Tf32Rounded(kmx) : kmx;
          sQp[(dl + x) * L::kLdT + i] = kTc ? mma::Tf32Rounded(qpx) : qpx;
          qgv[x] = qq * eg;
          kgv[x] = kk * ec;
          if (p.cache) {
            const int64_t e = ck + i * K + d + x;
            p.c.Ep[e] = ep, p.c.Em[e] = em, p.c.eG[e] = eg, p.c.EC[e] = ec;
            p.c.kp[e] = kpx, p.c.km[e] = kmx, p.c.qp[e] = qpx, p.c.X[e] = sB[i] * kk * eg;
          }
        }
        Store4(a.qg, a.wqk_bf16, ck + i * K + d, make_float4(qgv[0], qgv[1], qgv[2], qgv[3]));
        Store4(a.kg, a.wqk_bf16, ck + i * K + d, make_float4(kgv[0], kgv[1], kgv[2], kgv[3]));
      }
    }
    if (tid < KS) a.eGC[chunk * K + d0 + tid] = Exp<kTc>(G[(C - 1) * K + d0 + tid]);
    __syncthreads();
    if constexpr (kTc) {
#pragma unroll
      for (int w = 0; w < kPerWarp; ++w) {
        const int t = warp + w * kWarps;
        if (t >= 2 * kGramTiles) break;
        const int u = t % kGramTiles, ti0 = 16 * (u / (C / 8)), tj0 = 8 * (u % (C / 8));
        // a(i, m) = rows[m][i], b(m, j) = km[m][j]: the slices are stored transposed.
        if (tj0 < ti0 + 16) {
          kda_bwd::WarpTile<true, true>(tacc[w], t < kGramTiles ? sKp : sQp, 1, L::kLdT, sKm, L::kLdT, 1, ti0, tj0, 0, KS,
                                        lane);
        }
      }
    } else if (gram && tj <= ti) {
      const float* rows = qk ? sQp : sKp;
#pragma unroll 8
      for (int dd = 0; dd < KS; ++dd) OuterAdd(acc, rows + dd * L::kLdT + i0, sKm + dd * L::kLdT + j0);
    }
    __syncthreads();
  }
  if constexpr (kTc) {
#pragma unroll
    for (int w = 0; w < kPerWarp; ++w) {
      const int t = warp + w * kWarps;
      if (t >= 2 * kGramTiles) break;
      const int u = t % kGramTiles, ti0 = 16 * (u / (C / 8)), tj0 = 8 * (u % (C / 8));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = ti0 + kda_bwd::FragRow(lane, e), j = tj0 + kda_bwd::FragCol(lane, e);
        if (t >= kGramTiles) {
          a.Aqk[cc + i * C + j] = j <= i ? tacc[w][e] : 0.f;
        } else {
          const float lk = j < i ? tacc[w][e] : 0.f;
          if (p.cache) p.c.Lkk[cc + i * C + j] = lk;
          sA[i * L::kLdA + j] = lk * sB[i];
        }
      }
    }
  } else if (gram) {
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
  // X and Y into the slices' region (free since the last barrier), 4 columns a thread at a time
  // (vector loads and stores; the tensor-core form's products read them rounded to TF32, once
  // here); k and G again from global memory (the block read them above: mostly L2 hits).
  for (int e4 = tid; e4 < C * K / 4; e4 += kThreads) {
    const int i = e4 / (K / 4), d = 4 * (e4 % (K / 4));
    const int64_t t = t0 + i;
    float xv[4] = {0.f, 0.f, 0.f, 0.f};
    if (t < a.L) {
      const float4 k4 = Load4<kIn16>(kp, t * a.k_st + d, p.vec), g4 = *reinterpret_cast<const float4*>(G + i * K + d);
      const float kv[4] = {k4.x, k4.y, k4.z, k4.w}, gv[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const float xx = sB[i] * kv[x] * Exp<kTc>(gv[x]);
        xv[x] = kTc ? mma::Tf32Rounded(xx) : xx;
      }
    }
    *reinterpret_cast<float4*>(sX + i * L::kLdX + d) = make_float4(xv[0], xv[1], xv[2], xv[3]);
  }
  {
    // Y's (row, column) walk without a division by the run-time V: e4 = tid + s kThreads advances
    // the row by kThreads / (V / 4) and the column by 4 (kThreads % (V / 4)), carrying one row.
    const int vq = V / 4, step_i = kThreads / vq, step_d = 4 * (kThreads % vq);
    for (int i = tid / vq, d = 4 * (tid % vq); i < C;) {
      const int64_t t = t0 + i;
      const float4 v4 = t < a.L ? Load4<kIn16>(vp, t * a.v_st + d, p.vec) : make_float4(0.f, 0.f, 0.f, 0.f);
      const float yv[4] = {sB[i] * v4.x, sB[i] * v4.y, sB[i] * v4.z, sB[i] * v4.w};
      if (p.cache) {
#pragma unroll
        for (int x = 0; x < 4; ++x) p.c.Y[cv + i * V + d + x] = yv[x];
      }
      *reinterpret_cast<float4*>(sY + i * ldy + d) =
          kTc ? make_float4(mma::Tf32Rounded(yv[0]), mma::Tf32Rounded(yv[1]), mma::Tf32Rounded(yv[2]),
                            mma::Tf32Rounded(yv[3]))
              : make_float4(yv[0], yv[1], yv[2], yv[3]);
      d += step_d;
      i += step_i;
      if (d >= V) d -= V, ++i;
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
  if (float* Td = p.cache ? p.c.T : a.T_out; Td != nullptr) {
    for (int e = tid; e < C * C; e += kThreads) Td[cc + e] = sT[(e / C) * L::kLdA + e % C];
  }
  // D: W = T X, U = T Y by 4 x 4 tiles (rows r0.., columns c0..); T is lower: j <= r0 + 3. kTc:
  // by 16 x 8 warp tiles on the tensor cores, T's columns m < i0 + 16.
  if constexpr (kTc) {
    const int xt = (C / 16) * (K / 8), yt = (C / 16) * (V / 8);
    for (int t = warp; t < xt + yt; t += kWarps) {
      const bool is_x = t < xt;
      const int cols = is_x ? K : V, u = is_x ? t : t - xt;
      const int ti0 = 16 * (u / (cols / 8)), td0 = 8 * (u % (cols / 8));
      float out[4] = {};
      kda_bwd::WarpTile<false, true>(out, sT, L::kLdA, 1, is_x ? sX : sY, is_x ? L::kLdX : ldy, 1, ti0, td0, 0,
                                     ti0 + 16, lane);
      float* dst = is_x ? a.W + ck : a.U + cv;
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {  // the lane's rows g and g + 8, two adjacent columns each
        const int i = ti0 + kda_bwd::FragRow(lane, 2 * h2), d = td0 + kda_bwd::FragCol(lane, 2 * h2);
        const int64_t at = static_cast<int64_t>(i) * cols + d;
        if (is_x && a.wqk_bf16) {
          *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(static_cast<void*>(a.W)) + ck + at) =
              PackBf16(out[2 * h2], out[2 * h2 + 1]);
        } else {
          *reinterpret_cast<float2*>(dst + at) = make_float2(out[2 * h2], out[2 * h2 + 1]);
        }
      }
    }
    return;
  }
  auto product = [&](const float* src, int ld, int cols, float* dst) {
    const int tiles = (C / 4) * (cols / 4);
    for (int t = tid; t < tiles; t += kThreads) {
      const int r0 = 4 * (t / (cols / 4)), c0 = 4 * (t % (cols / 4));
      float out[4][4] = {};
      for (int j = 0; j < r0 + 4; ++j) {
        const float4 w = *reinterpret_cast<const float4*>(src + j * ld + c0);
        const float bv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const float tv = sT[(r0 + x) * L::kLdA + j];
#pragma unroll
          for (int y = 0; y < 4; ++y) out[x][y] = fmaf(tv, bv[y], out[x][y]);
        }
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        *reinterpret_cast<float4*>(dst + static_cast<int64_t>(r0 + r) * cols + c0) =
            make_float4(out[r][0], out[r][1], out[r][2], out[r][3]);
      }
    }
  };
  product(sX, L::kLdX, K, a.W + ck);
  product(sY, ldy, V, a.U + cv);
}

template <int C, int K, bool kTc, bool kIn16>
int Launch(const Params& p, cudaStream_t stream) {
  const auto kernel = &IntraKernel<C, K, kTc, kIn16>;
  const size_t bytes = static_cast<size_t>(Smem<C, K, kTc>::Floats(static_cast<int>(p.a.V))) * sizeof(float);
  // Above 48 KB of dynamic shared memory a kernel has to opt in (sm_90 allows 227 KB).
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  // All of the multiprocessor's unified L1 as shared memory: room for two blocks.
  const cudaError_t carve = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                 static_cast<int>(cudaSharedmemCarveoutMaxShared));
  if (carve != cudaSuccess) return static_cast<int>(carve);
  const dim3 grid(static_cast<unsigned>(p.a.N), static_cast<unsigned>(p.a.B * p.a.HV));
  kernel<<<grid, kThreads, bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool KdaIntraSupported(int64_t C, int64_t K, int64_t V) {
  return (C == 32 || C == 64) && (K == 32 || K == 64 || K == 128) && V >= 4 && V <= 128 && V % 4 == 0;
}

bool KdaIntraVectorLoads(const KdaIntraArgs& a) {
  const int64_t bytes = KdaQkvBf16(a.bf16) ? 8 : 16;
  return KdaAligned(a.q, bytes) && KdaAligned(a.k, bytes) && KdaAligned(a.v, bytes) && a.q_sb % 4 == 0 &&
         a.q_sh % 4 == 0 && a.q_st % 4 == 0 && a.k_sb % 4 == 0 && a.k_sh % 4 == 0 && a.k_st % 4 == 0 &&
         a.v_sb % 4 == 0 && a.v_sh % 4 == 0 && a.v_st % 4 == 0;
}

int KdaIntraForward(const KdaIntraArgs& a, void* stream) {
  if (!KdaIntraSupported(a.C, a.K, a.V) || a.N <= 0 || a.B <= 0 || a.HV <= 0 || a.B * a.HV > 65535 ||
      a.N > 2147483647 || a.L > a.N * a.C || !KdaQkvSameDtype(a.bf16) ||
      (a.wqk_bf16 && (!a.tf32 || a.V % 8 != 0 || a.cache != nullptr)) ||
      (a.T_out != nullptr && a.cache != nullptr) || !KdaAligned(a.G, 16) || !KdaAligned(a.qg, 16) ||
      !KdaAligned(a.kg, 16) || !KdaAligned(a.W, 16)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const Params p{a, a.cache != nullptr ? *a.cache : KdaIntraCache{}, a.cache != nullptr, KdaIntraVectorLoads(a)};
  const auto s = static_cast<cudaStream_t>(stream);
  // The tensor-core form needs every product's width a whole number of 8-column tiles.
  const bool tc = a.tf32 && a.V % 8 == 0;
  return ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    constexpr int Cc = decltype(c)::value, Kc = decltype(k)::value;
    if (KdaQkvBf16(a.bf16)) return tc ? Launch<Cc, Kc, true, true>(p, s) : Launch<Cc, Kc, false, true>(p, s);
    return tc ? Launch<Cc, Kc, true, false>(p, s) : Launch<Cc, Kc, false, false>(p, s);
  });
}

}  // namespace odyssey::kernels::cuda
