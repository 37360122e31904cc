// Chunked KDA's chunk-local quantities, whole-chunk Gram form (see kda_intra.h), fp32 on CUDA
// cores. One block of 512 threads per (batch x head, chunk), the chunk in shared memory, two blocks
// to a multiprocessor (shared memory ~105 KB a block at C = 64, K = V = 128; 64 registers a
// thread): one block's barriers and serial steps (the inverse) overlap the other's loads. Phases:
//   A: element-wise over one slice of KS = min(K, 64) key columns at a time (a warp's lanes on
//      consecutive columns of a row: coalesced global access): kp, km, qp of the slice into shared
//      memory transposed (column d's C values contiguous); qg, kg, eGC (and the cache's factors)
//      out.
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
// fragments' rows in distinct banks). The factors, X, Y and the inverse are the same code.
// Before the slices (one block a multiprocessor, 227 KB) the kernel held all of kp, km, qp, X, Y
// and T's transpose at once: 25% occupancy, latency-bound (ncu at 32K tokens: 3.75 ms, 910 GB/s,
// 9 cycles a warp between issues).
#include "kernels/cuda/kda_intra.h"

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
  // The inputs, fp32 or bf16 (kIn16; beta by its own bit): token t's element d; q scaled as read.
  using In = std::conditional_t<kIn16, uint16_t, float>;
  const In* qp = static_cast<const In*>(a.q) + b * a.q_sb + h * a.q_sh;
  const In* kp = static_cast<const In*>(a.k) + b * a.k_sb + h * a.k_sh;
  const In* vp = static_cast<const In*>(a.v) + b * a.v_sb + h * a.v_sh;
  const int64_t bo = b * a.b_sb + h * a.b_sh;
  const bool b16 = a.bf16 & kKdaBf16Beta;
  auto q = [&](int64_t t, int d) { return KdaLoadAs<kIn16>(qp, t * a.q_st + d) * a.q_scale; };
  auto k = [&](int64_t t, int d) { return KdaLoadAs<kIn16>(kp, t * a.k_st + d); };
  auto v = [&](int64_t t, int d) { return KdaLoadAs<kIn16>(vp, t * a.v_st + d); };
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

  // A thread's elements e = tid + s kThreads of a slice share their column (kThreads is a multiple
  // of KS), and the inputs of 4 of them are loaded before any is used: the loads are in flight
  // together instead of one element's at a time (the stores below may alias the inputs as far as
  // the compiler knows, so it would not hoist them itself).
  static_assert(kThreads % KS == 0 && (C * KS) % kThreads == 0 && K % KS == 0, "a thread's elements share a column");
  constexpr int kPer = C * KS / kThreads, kBatch = kPer < 4 ? kPer : 4;
  for (int d0 = 0; d0 < K; d0 += KS) {
    const int dl = tid % KS, d = d0 + dl;
    const float g0 = G[d], gc = G[(C - 1) * K + d];
    for (int s0 = 0; s0 < kPer; s0 += kBatch) {
      float gs[kBatch], ks[kBatch], qs[kBatch];
#pragma unroll
      for (int s = 0; s < kBatch; ++s) {
        const int i = (tid + (s0 + s) * kThreads) / KS;
        const int64_t t = t0 + i;
        const bool in = t < a.L;
        gs[s] = G[i * K + d];
        ks[s] = in ? k(t, d) : 0.f;
        qs[s] = in ? q(t, d) : 0.f;
      }
#pragma unroll
      for (int s = 0; s < kBatch; ++s) {
        const int i = (tid + (s0 + s) * kThreads) / KS, e = i * K + d;
        const float g = gs[s], kk = ks[s], qq = qs[s];
        const float ep = expf(g - g0), em = expf(g0 - g), eg = expf(g), ec = expf(gc - g);
        const float kp = kk * ep, km = kk * em, qp = qq * ep;
        sKp[dl * L::kLdT + i] = kp;
        sKm[dl * L::kLdT + i] = km;
        sQp[dl * L::kLdT + i] = qp;
        KdaStore(a.qg, a.wqk_bf16, ck + e, qq * eg);
        KdaStore(a.kg, a.wqk_bf16, ck + e, kk * ec);
        if (i == 0) a.eGC[chunk * K + d] = expf(gc);
        if (p.cache) {
          p.c.Ep[ck + e] = ep, p.c.Em[ck + e] = em, p.c.eG[ck + e] = eg, p.c.EC[ck + e] = ec;
          p.c.kp[ck + e] = kp, p.c.km[ck + e] = km, p.c.qp[ck + e] = qp, p.c.X[ck + e] = sB[i] * kk * eg;
        }
      }
    }
    __syncthreads();
    if constexpr (kTc) {
#pragma unroll
      for (int w = 0; w < kPerWarp; ++w) {
        const int t = warp + w * kWarps;
        if (t >= 2 * kGramTiles) break;
        const int u = t % kGramTiles, ti0 = 16 * (u / (C / 8)), tj0 = 8 * (u % (C / 8));
        // a(i, m) = rows[m][i], b(m, j) = km[m][j]: the slices are stored transposed.
        if (tj0 < ti0 + 16) {
          kda_bwd::WarpTile(tacc[w], t < kGramTiles ? sKp : sQp, 1, L::kLdT, sKm, L::kLdT, 1, ti0, tj0, 0, KS, lane);
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
  // X and Y into the slices' region (free since the last barrier); k and G again from global
  // memory (the block read them above: mostly L2 hits).
  for (int e = tid; e < C * K; e += kThreads) {
    const int i = e / K, d = e % K;
    const int64_t t = t0 + i;
    sX[i * L::kLdX + d] = t < a.L ? sB[i] * k(t, d) * expf(G[e]) : 0.f;
  }
  for (int e = tid; e < C * V; e += kThreads) {
    const int i = e / V, d = e % V;
    const int64_t t = t0 + i;
    const float y = sB[i] * (t < a.L ? v(t, d) : 0.f);
    sY[i * ldy + d] = y;
    if (p.cache) p.c.Y[cv + e] = y;
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
      kda_bwd::WarpTile(out, sT, L::kLdA, 1, is_x ? sX : sY, is_x ? L::kLdX : ldy, 1, ti0, td0, 0, ti0 + 16, lane);
      float* dst = is_x ? a.W + ck : a.U + cv;
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {  // the lane's rows g and g + 8, two adjacent columns each
        const int i = ti0 + kda_bwd::FragRow(lane, 2 * h2), d = td0 + kda_bwd::FragCol(lane, 2 * h2);
        const int64_t at = static_cast<int64_t>(i) * cols + d;
        if (is_x && a.wqk_bf16) {
          KdaStore(a.W, true, ck + at, out[2 * h2]);
          KdaStore(a.W, true, ck + at + 1, out[2 * h2 + 1]);
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

int KdaIntraForward(const KdaIntraArgs& a, void* stream) {
  if (!KdaIntraSupported(a.C, a.K, a.V) || a.N <= 0 || a.B <= 0 || a.HV <= 0 || a.B * a.HV > 65535 ||
      a.N > 2147483647 || a.L > a.N * a.C || !KdaQkvSameDtype(a.bf16) ||
      (a.wqk_bf16 && (!a.tf32 || a.V % 8 != 0 || a.cache != nullptr)) ||
      (a.T_out != nullptr && a.cache != nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const Params p{a, a.cache != nullptr ? *a.cache : KdaIntraCache{}, a.cache != nullptr};
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
