// Sparse attention over selected keys on the tensor cores (see sparse_attention_mma.h): bf16
// operands, fp32 accumulators, mma.sync m16n8k16, 128 threads (four warps) a block.
//
// Why: the CUDA-core kernels (sparse_attention.cu) give each lane a whole gathered row, so every
// load instruction touches 32 rows: 32 L1 wavefronts for 512 bytes, 16 bytes a cycle an SM,
// which is where their forward sat (4.2 TB/s over the H200's SMs). Here a warp gathers 16 rows
// together into shared memory with cp.async, 16 lanes a row (a row per 16 lanes, whole 128-byte
// lines), and the products run from shared memory through ldmatrix on the tensor cores: the walk
// is bound by the gather's bytes from L2 and HBM, not by L1 wavefronts, shuffles or FMA issue.
//
// The fragment layouts and helpers are mma.cuh's.
#include "kernels/cuda/sparse_attention_mma.h"

#include "kernels/cuda/mma.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace odyssey::kernels::cuda {
namespace {

using namespace mma;  // NOLINT(build/namespaces): the fragment helpers of mma.cuh

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kRows = 16;      // rows a warp gathers at a time (an mma's M or K)
constexpr int kTStride = 24;   // row stride (elements) of the 8 x 16 transposes (conflict-free)
constexpr int kMaxGroup = 8;   // heads sharing a KV head: an mma's N

// Gathers 16 rows of C columns (bf16) into a row-major tile (stride C + kPad): row i is
// base + off(i), off from lane i's `row_off` (-1: zeros). Every lane of the warp calls it.
template <int C>
__device__ __forceinline__ void GatherRows(bf16* tile, const bf16* base, int64_t row_off, int lane) {
  constexpr int kChunks = C / 8;  // 16-byte chunks a row
  constexpr int kPer = kRows * kChunks / 32;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int x = lane + 32 * j, i = x / kChunks, ch = x % kChunks;
    const int64_t off = __shfl_sync(kFull, row_off, i);
    CpAsync16(tile + i * (C + kPad) + ch * 8, off >= 0 ? base + off + ch * 8 : base, off >= 0);
  }
}

// Stores an fp32 C fragment (rows: 16 items, columns: 8) transposed into hi[col][row] and
// lo[col][row] (stride kTStride): x's bf16 rounding and the remainder x - hi, also in bf16, so that
// two mma with the pair carry ~16 bits of x (an mma's B operand is bf16: one part alone would round
// p and ds to 8 bits, where the CUDA-core kernels keep fp32). B fragments with K = the 16 items
// read them with 32-bit loads (LoadBT).
__device__ __forceinline__ void StoreTSplit(bf16* hi, bf16* lo, const float (&x)[4], int lane) {
  const int g = lane / 4, c = lane % 4;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const bf16 h = __float2bfloat16(x[e]);
    const int at = (2 * c + e % 2) * kTStride + g + 8 * (e / 2);
    hi[at] = h;
    lo[at] = __float2bfloat16(x[e] - __bfloat162float(h));
  }
}
// The B fragments (K = 16 items, N = 8 columns) of the two parts StoreTSplit wrote.
__device__ __forceinline__ SplitB LoadBT(const bf16* hi, const bf16* lo, int lane) {
  const int at = (lane / 4) * kTStride + 2 * (lane % 4);
  return {Lds32(hi + at), Lds32(hi + at + 8), Lds32(lo + at), Lds32(lo + at + 8)};
}

struct QueryBlockAt {
  int64_t t, b;
  int hk, G;
};
__device__ __forceinline__ QueryBlockAt At(const SparseAttentionArgs& a) {
  return {static_cast<int64_t>(blockIdx.x), static_cast<int64_t>(blockIdx.z), static_cast<int>(blockIdx.y),
          static_cast<int>(a.H / a.Hkv)};
}

// Stages the G rows (heads hk G ..) of token t of r into an 8-row tile (rows >= G zero).
template <int C>
__device__ __forceinline__ void StageHeads(bf16* tile, const SparseRows& r, const QueryBlockAt& at) {
  const bf16* p = static_cast<const bf16*>(r.p) + at.b * r.sb + at.t * r.ss;
  for (int i = threadIdx.x; i < kMaxGroup * C; i += kThreads) {
    const int g = i / C, d = i - g * C;
    tile[g * (C + kPad) + d] = g < at.G ? p[(at.hk * at.G + g) * r.sh + d] : __float2bfloat16(0.f);
  }
}

// Lane i < 16's key of the warp's 16 entries from j0 (-1 past W), as a row offset of k / v.
__device__ __forceinline__ int ChunkKey(const int32_t* ir, int64_t W, int64_t j0, int lane) {
  const int64_t j = j0 + (lane & 15);
  return j < W ? ir[j] : -1;
}

// ---- Forward: O^T (Dv x heads) over the selection, online softmax per head -------------------
// One block per (token, KV head, batch row); warps take 16 selected keys at a time. Per chunk:
// S^T = K_c Q^T (16 keys x 8 heads), p = exp2(S^T - m) with a running max per head (the columns
// a lane holds: heads 2c, 2c + 1), O^T += V_c^T P (P through a transpose in shared memory).
template <int D, int Dv>
__global__ void __launch_bounds__(kThreads) ForwardMmaKernel(SparseAttentionArgs a, SparseOutRows out, float* lse) {
  constexpr int KS = D + kPad, VS = Dv + kPad;
  static_assert(kWarps * kMaxGroup * Dv * 4 <= kWarps * kRows * (KS + VS) * 2, "the merge fits the tiles");
  __shared__ alignas(16) bf16 qs[kMaxGroup * KS];
  __shared__ alignas(16) bf16 tiles[kWarps][kRows * (KS + VS)];  // a warp's K rows, then its V rows
  __shared__ alignas(16) bf16 pt[kWarps][2][kMaxGroup * kTStride];  // P's two bf16 parts
  __shared__ float red_m[kWarps][kMaxGroup], red_l[kWarps][kMaxGroup];
  const QueryBlockAt at = At(a);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  StageHeads<D>(qs, a.q, at);
  __syncthreads();
  uint32_t qb[D / 16][2];
  LoadBAll<D>(qb, qs, KS, lane);
  const float sl2 = a.scale * kLog2e;
  const bf16* kb = static_cast<const bf16*>(a.k.p) + at.b * a.k.sb + at.hk * a.k.sh;
  const bf16* vb = static_cast<const bf16*>(a.v.p) + at.b * a.v.sb + at.hk * a.v.sh;
  const int32_t* ir = a.idx + (at.b * a.S + at.t) * a.W;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, acc[Dv / 16][4];
#pragma unroll
  for (int mt = 0; mt < Dv / 16; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  bf16* kt = tiles[warp];
  bf16* vt = kt + kRows * KS;
  for (int64_t j0 = warp * kRows; j0 < a.W; j0 += kWarps * kRows) {
    const int key = ChunkKey(ir, a.W, j0, lane);
    if (!__any_sync(kFull, key >= 0)) continue;
    GatherRows<D>(kt, kb, key >= 0 ? key * a.k.ss : -1, lane);
    GatherRows<Dv>(vt, vb, key >= 0 ? key * a.v.ss : -1, lane);
    CpAsyncWait();
    __syncwarp();
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    RowsTimesB<D>(s, kt, KS, qb, lane);
    const bool v0 = __shfl_sync(kFull, key, g) >= 0, v1 = __shfl_sync(kFull, key, g + 8) >= 0;
    float p[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float s0 = v0 ? s[h] * sl2 : -INFINITY, s1 = v1 ? s[2 + h] * sl2 : -INFINITY;
      float cm = fmaxf(s0, s1);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) cm = fmaxf(cm, __shfl_xor_sync(kFull, cm, o));
      const float mn = fmaxf(m[h], cm);  // finite: the chunk holds a key
      const float corr = exp2f(m[h] - mn);
      p[h] = exp2f(s0 - mn), p[2 + h] = exp2f(s1 - mn);
      float ps = p[h] + p[2 + h];
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) ps += __shfl_xor_sync(kFull, ps, o);
      l[h] = l[h] * corr + ps;
      m[h] = mn;
#pragma unroll
      for (int mt = 0; mt < Dv / 16; ++mt) acc[mt][h] *= corr, acc[mt][2 + h] *= corr;
    }
    StoreTSplit(pt[warp][0], pt[warp][1], p, lane);
    __syncwarp();
    TransposedTimesB<Dv>(acc, vt, VS, LoadBT(pt[warp][0], pt[warp][1], lane), lane);
    __syncwarp();  // the tiles are read before the next gather writes them
  }
  // Merge the four warps: each holds (m, l) of heads 2c, 2c + 1 and O^T columns for them.
  if (g == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) red_m[warp][2 * c + h] = m[h], red_l[warp][2 * c + h] = l[h];
  }
  __syncthreads();
  float* red_o = reinterpret_cast<float*>(&tiles[0][0]);  // [warp][head][Dv] fp32: 16 KB at Dv 128
  float scale_w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, red_m[w][2 * c + h]);
    scale_w[h] = M == -INFINITY ? 0.f : exp2f(m[h] - M);
  }
#pragma unroll
  for (int mt = 0; mt < Dv / 16; ++mt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = mt * 16 + g + 8 * (e / 2), h = 2 * c + e % 2;
      red_o[(warp * kMaxGroup + h) * Dv + d] = acc[mt][e] * scale_w[e % 2];
    }
  }
  __syncthreads();
  bf16* ob = static_cast<bf16*>(out.p) + at.b * out.sb + at.t * out.ss;
  for (int i = threadIdx.x; i < at.G * Dv; i += kThreads) {
    const int h = i / Dv, d = i - h * Dv;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, red_m[w][h]);
    float L = 0.f, o = 0.f;
    if (M > -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        L += red_l[w][h] * exp2f(red_m[w][h] - M);
        o += red_o[(w * kMaxGroup + h) * Dv + d];
      }
    }
    const int head = at.hk * at.G + h;
    ob[head * out.sh + d] = __float2bfloat16(L > 0.f ? o / L : 0.f);
    if (d == 0) lse[(at.b * a.H + head) * a.S + at.t] = L > 0.f ? (M + log2f(L)) / kLog2e : -INFINITY;
  }
}

// ---- Backward, query side ---------------------------------------------------------------------
// The forward's walk recomputing p from the log-sum-exp, dP^T = V_c dO^T; accumulates
// A^T += K_c^T (p dp) and B^T += K_c^T p (each operand split in two bf16 parts: dq = scale (A -
// delta B) subtracts two sums, so they carry ~16 bits, not 8) and delta = sum p dp in fp32.
template <int D, int Dv>
__global__ void __launch_bounds__(kThreads)
    BackwardQueryMmaKernel(SparseAttentionArgs a, SparseRows dO, const float* lse, SparseOutRows dq, float* delta) {
  constexpr int KS = D + kPad, VS = Dv + kPad;
  static_assert(kWarps * kMaxGroup * D * 4 <= kWarps * kRows * (KS + VS) * 2, "a merge pass fits the tiles");
  __shared__ alignas(16) bf16 qs[kMaxGroup * KS];
  __shared__ alignas(16) bf16 dos[kMaxGroup * VS];
  __shared__ alignas(16) bf16 tiles[kWarps][kRows * (KS + VS)];  // a warp's K rows, then its V rows
  __shared__ alignas(16) bf16 tt[kWarps][4][kMaxGroup * kTStride];
  __shared__ float red_delta[kWarps][kMaxGroup];
  const QueryBlockAt at = At(a);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  StageHeads<D>(qs, a.q, at);
  StageHeads<Dv>(dos, dO, at);
  __syncthreads();
  uint32_t qb[D / 16][2], ob[Dv / 16][2];
  LoadBAll<D>(qb, qs, KS, lane);
  LoadBAll<Dv>(ob, dos, VS, lane);
  const float sl2 = a.scale * kLog2e;
  float l2[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int hh = 2 * c + h;
    l2[h] = hh < at.G ? lse[(at.b * a.H + at.hk * at.G + hh) * a.S + at.t] * kLog2e : INFINITY;
  }
  const bf16* kb = static_cast<const bf16*>(a.k.p) + at.b * a.k.sb + at.hk * a.k.sh;
  const bf16* vb = static_cast<const bf16*>(a.v.p) + at.b * a.v.sb + at.hk * a.v.sh;
  const int32_t* ir = a.idx + (at.b * a.S + at.t) * a.W;
  float acc_a[D / 16][4], acc_b[D / 16][4], dlt[2] = {0.f, 0.f};
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_a[mt][e] = 0.f, acc_b[mt][e] = 0.f;
  }
  bf16* kt = tiles[warp];
  bf16* vt = kt + kRows * KS;
  bf16 *pa_hi = tt[warp][0], *pa_lo = tt[warp][1], *pb_hi = tt[warp][2], *pb_lo = tt[warp][3];
  for (int64_t j0 = warp * kRows; j0 < a.W; j0 += kWarps * kRows) {
    const int key = ChunkKey(ir, a.W, j0, lane);
    if (!__any_sync(kFull, key >= 0)) continue;
    GatherRows<D>(kt, kb, key >= 0 ? key * a.k.ss : -1, lane);
    GatherRows<Dv>(vt, vb, key >= 0 ? key * a.v.ss : -1, lane);
    CpAsyncWait();
    __syncwarp();
    float s[4] = {0.f, 0.f, 0.f, 0.f}, dp[4] = {0.f, 0.f, 0.f, 0.f};
    RowsTimesB<D>(s, kt, KS, qb, lane);
    RowsTimesB<Dv>(dp, vt, VS, ob, lane);
    const bool v0 = __shfl_sync(kFull, key, g) >= 0, v1 = __shfl_sync(kFull, key, g + 8) >= 0;
    float p[4], pdp[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool valid = e < 2 ? v0 : v1;
      p[e] = valid ? exp2f(s[e] * sl2 - l2[e % 2]) : 0.f;  // 0 for the padded heads (l2 = inf)
      pdp[e] = p[e] * dp[e];
      dlt[e % 2] += pdp[e];
    }
    StoreTSplit(pa_hi, pa_lo, pdp, lane);
    StoreTSplit(pb_hi, pb_lo, p, lane);
    __syncwarp();
    const SplitB ba = LoadBT(pa_hi, pa_lo, lane), bb = LoadBT(pb_hi, pb_lo, lane);
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {  // one load of K_c^T for both sums
      uint32_t af[4];
      LoadAT(af, kt, KS, mt * 16, lane);
      MmaSplit(acc_a[mt], af, ba);
      MmaSplit(acc_b[mt], af, bb);
    }
    __syncwarp();
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) dlt[h] += __shfl_xor_sync(kFull, dlt[h], o);
  }
  if (g == 0) red_delta[warp][2 * c] = dlt[0], red_delta[warp][2 * c + 1] = dlt[1];
  __syncthreads();
  // Two passes over the gather tiles (done): A's sums, then B's ([warp][head][D] fp32, 16 KB at D
  // 128); a thread keeps its elements' A sums in registers between them.
  float* red = reinterpret_cast<float*>(&tiles[0][0]);
  constexpr int kMine = kMaxGroup * D / kThreads;  // elements a thread finishes
  float sa[kMine];
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = mt * 16 + g + 8 * (e / 2), h = 2 * c + e % 2;
        red[(warp * kMaxGroup + h) * D + d] = pass == 0 ? acc_a[mt][e] : acc_b[mt][e];
      }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kMine; ++j) {
      const int i = threadIdx.x + j * kThreads, h = i / D, d = i - h * D;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += red[(w * kMaxGroup + h) * D + d];
      if (pass == 0) {
        sa[j] = sum;
      } else if (h < at.G) {
        float dl = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) dl += red_delta[w][h];
        const int head = at.hk * at.G + h;
        bf16* qo = static_cast<bf16*>(dq.p) + at.b * dq.sb + at.t * dq.ss;
        qo[head * dq.sh + d] = __float2bfloat16((sa[j] - dl * sum) * a.scale);
        if (d == 0) delta[(at.b * a.H + head) * a.S + at.t] = dl;
      }
    }
    __syncthreads();  // the first pass's sums are read before the second writes
  }
}

// ---- Backward, key side -----------------------------------------------------------------------
// One block per (aligned block of kSparseKeyBlock keys, KV head, batch row). Its rows are the
// (unit, head) pairs of its units (a unit: one query's run of entries in the block); warps take
// 16 rows at a time and gather their q and dO rows. S = Q K_blk^T and dP = dO V_blk^T (16 rows x
// 8 key columns, 4 real), p and ds per row's key mask, then dK^T += Q^T ds and dV^T += dO^T p
// (the 4 keys' columns). A warp's rows are fixed and the four warps' sums merge in a fixed order:
// deterministic, no atomics; the block adds its keys' rows to the fp32 accumulators.
constexpr int kKeys = kSparseKeyBlock;
static_assert(kKeys <= 8, "a key block fits an mma's N");

template <int D, int Dv>
__global__ void __launch_bounds__(kThreads)
    BackwardKeysMmaKernel(SparseAttentionArgs a, SparseRows dO, const float* lse, const float* delta,
                          SparseKeyUnits u, float* dk_acc, float* dv_acc) {
  constexpr int KS = D + kPad, VS = Dv + kPad;
  const int64_t blk = blockIdx.x, b = blockIdx.z;
  const int hk = blockIdx.y;
  const int64_t nb = (a.Sk + kKeys - 1) / kKeys;
  const int64_t lo = u.offsets[b * nb + blk], hi = u.offsets[b * nb + blk + 1];
  if (lo == hi) return;
  __shared__ alignas(16) bf16 kblk[8 * KS];
  __shared__ alignas(16) bf16 vblk[8 * VS];
  static_assert(kWarps * kKeys * (D + Dv) * 4 <= kWarps * kRows * (KS + VS) * 2, "the merge fits the tiles");
  __shared__ alignas(16) bf16 tiles[kWarps][kRows * (KS + VS)];  // a warp's q rows, then its dO rows
  __shared__ alignas(16) bf16 tt[kWarps][4][8 * kTStride];  // p, ds: two bf16 parts each
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  {
    const bf16* kb = static_cast<const bf16*>(a.k.p) + b * a.k.sb + hk * a.k.sh;
    const bf16* vb = static_cast<const bf16*>(a.v.p) + b * a.v.sb + hk * a.v.sh;
    for (int i = threadIdx.x; i < 8 * D; i += kThreads) {
      const int s = i / D, d = i - s * D;
      const int64_t key = blk * kKeys + s;
      kblk[s * KS + d] = s < kKeys && key < a.Sk ? kb[key * a.k.ss + d] : __float2bfloat16(0.f);
    }
    for (int i = threadIdx.x; i < 8 * Dv; i += kThreads) {
      const int s = i / Dv, d = i - s * Dv;
      const int64_t key = blk * kKeys + s;
      vblk[s * VS + d] = s < kKeys && key < a.Sk ? vb[key * a.v.ss + d] : __float2bfloat16(0.f);
    }
  }
  __syncthreads();
  uint32_t kf[D / 16][2], vf[Dv / 16][2];
  LoadBAll<D>(kf, kblk, KS, lane);
  LoadBAll<Dv>(vf, vblk, VS, lane);
  const int G = static_cast<int>(a.H / a.Hkv);
  const int64_t R = (hi - lo) * G;
  const float sl2 = a.scale * kLog2e;
  const bf16* qp = static_cast<const bf16*>(a.q.p) + b * a.q.sb;
  const bf16* op = static_cast<const bf16*>(dO.p) + b * dO.sb;
  float dk[D / 16][4], dv[Dv / 16][4];
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) dk[mt][0] = dk[mt][1] = dk[mt][2] = dk[mt][3] = 0.f;
#pragma unroll
  for (int mt = 0; mt < Dv / 16; ++mt) dv[mt][0] = dv[mt][1] = dv[mt][2] = dv[mt][3] = 0.f;
  bf16* qt = tiles[warp];
  bf16* ot = qt + kRows * KS;
  for (int64_t r0 = warp * kRows; r0 < R; r0 += kWarps * kRows) {
    // Lane i < 16 (and i + 16 alike) reads row r0 + i: its query, head, key mask, lse and delta.
    int64_t q_off = -1, o_off = -1;
    unsigned mask = 0;
    float l2 = 0.f, dl = 0.f;
    {
      const int64_t r = r0 + (lane & 15);
      if (r < R) {
        const int64_t unit = lo + r / G;
        const int h = hk * G + static_cast<int>(r % G);
        const int64_t e = u.first[unit];  // (b * rows + t - t0) * W + w
        const int64_t row = e / a.W, w0 = e - row * a.W;
        const int64_t t = row - b * u.rows + u.t0;
        const int32_t* ir = a.idx + (b * a.S + t) * a.W;
        int prev = -1;
        for (int64_t w = w0; w < a.W && w < w0 + kKeys; ++w) {
          const int key = ir[w];
          if (key < 0 || key / kKeys != blk || key <= prev) break;
          mask |= 1u << (key % kKeys);
          prev = key;
        }
        q_off = h * a.q.sh + t * a.q.ss;
        o_off = h * dO.sh + t * dO.ss;
        const int64_t lrow = (b * a.H + h) * a.S + t;
        l2 = lse[lrow] * kLog2e;
        dl = delta[lrow];
      }
    }
    GatherRows<D>(qt, qp, q_off, lane);
    GatherRows<Dv>(ot, op, o_off, lane);
    CpAsyncWait();
    __syncwarp();
    float s[4] = {0.f, 0.f, 0.f, 0.f}, dp[4] = {0.f, 0.f, 0.f, 0.f};
    RowsTimesB<D>(s, qt, KS, kf, lane);
    RowsTimesB<Dv>(dp, ot, VS, vf, lane);
    float p[4], ds[4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int src = g + 8 * half;
      const unsigned mk = __shfl_sync(kFull, mask, src);
      const float lr = __shfl_sync(kFull, l2, src), dr = __shfl_sync(kFull, dl, src);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int e = 2 * half + j, key = 2 * c + j;
        const bool on = key < kKeys && ((mk >> key) & 1u);
        p[e] = on ? exp2f(s[e] * sl2 - lr) : 0.f;
        ds[e] = p[e] * (dp[e] - dr);
      }
    }
    StoreTSplit(tt[warp][0], tt[warp][1], p, lane);
    StoreTSplit(tt[warp][2], tt[warp][3], ds, lane);
    __syncwarp();
    TransposedTimesB<Dv>(dv, ot, VS, LoadBT(tt[warp][0], tt[warp][1], lane), lane);
    TransposedTimesB<D>(dk, qt, KS, LoadBT(tt[warp][2], tt[warp][3], lane), lane);
    __syncwarp();
  }
  __syncthreads();
  // [warp][key][D + Dv] fp32 (16 KB at 128 / 128) over the gather tiles, which are done.
  float* red = reinterpret_cast<float*>(&tiles[0][0]);
  if (c < kKeys / 2) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = 2 * c + e % 2, row = g + 8 * (e / 2);
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) red[(warp * kKeys + key) * (D + Dv) + mt * 16 + row] = dk[mt][e];
#pragma unroll
      for (int mt = 0; mt < Dv / 16; ++mt) red[(warp * kKeys + key) * (D + Dv) + D + mt * 16 + row] = dv[mt][e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kKeys * (D + Dv); i += kThreads) {
    const int s = i / (D + Dv), col = i - s * (D + Dv);
    const int64_t key = blk * kKeys + s;
    if (key >= a.Sk) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[(w * kKeys + s) * (D + Dv) + col];
    if (col < D) {
      dk_acc[((b * a.Hkv + hk) * a.Sk + key) * D + col] += sum * a.scale;
    } else {
      dv_acc[((b * a.Hkv + hk) * a.Sk + key) * Dv + col - D] += sum;
    }
  }
}

// ---- Head-mean probabilities given the log-sum-exp ---------------------------------------------
// One block per (token, batch row); a warp owns 16 selected entries at a time and walks the KV
// heads for them: S^T = K_c Q_hk^T, p = exp2(S^T - lse) summed over the group's heads (the
// lanes of a row), then over the KV heads in order in registers: deterministic, no atomics.
template <int D>
__global__ void __launch_bounds__(kThreads) ProbsMmaKernel(SparseAttentionArgs a, const float* lse_in, float* probs) {
  constexpr int KS = D + kPad;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* qs = reinterpret_cast<bf16*>(smem_raw);                       // [Hkv][8][KS]
  bf16* kbuf = qs + a.Hkv * kMaxGroup * KS;                           // [warp][16][KS]
  float* l2s = reinterpret_cast<float*>(kbuf + kWarps * kRows * KS);  // [Hkv][8]
  const int64_t t = blockIdx.x, b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int G = static_cast<int>(a.H / a.Hkv), Hkv = static_cast<int>(a.Hkv);
  {
    const bf16* p = static_cast<const bf16*>(a.q.p) + b * a.q.sb + t * a.q.ss;
    for (int i = threadIdx.x; i < Hkv * kMaxGroup * D; i += kThreads) {
      const int row = i / D, d = i - row * D, hk = row / kMaxGroup, gg = row % kMaxGroup;
      qs[row * KS + d] = gg < G ? p[(hk * G + gg) * a.q.sh + d] : __float2bfloat16(0.f);
    }
    for (int i = threadIdx.x; i < Hkv * kMaxGroup; i += kThreads) {
      const int hk = i / kMaxGroup, gg = i % kMaxGroup;
      // -inf (a row without keys) and the padded heads give p = 0.
      const float v = gg < G ? lse_in[(b * a.H + hk * G + gg) * a.S + t] : -INFINITY;
      l2s[i] = v == -INFINITY ? INFINITY : v * kLog2e;
    }
  }
  __syncthreads();
  const float sl2 = a.scale * kLog2e, inv_h = 1.f / static_cast<float>(a.H);
  const int32_t* ir = a.idx + (b * a.S + t) * a.W;
  float* pr = probs + (b * a.S + t) * a.W;
  bf16* kt = kbuf + warp * kRows * KS;
  for (int64_t j0 = warp * kRows; j0 < a.W; j0 += kWarps * kRows) {
    const int key = ChunkKey(ir, a.W, j0, lane);
    const bool any = __any_sync(kFull, key >= 0);
    const bool v0 = __shfl_sync(kFull, key, g) >= 0, v1 = __shfl_sync(kFull, key, g + 8) >= 0;
    float sum0 = 0.f, sum1 = 0.f;  // rows g and g + 8: the entries j0 + g, j0 + g + 8
    for (int hk = 0; any && hk < Hkv; ++hk) {
      const bf16* kb = static_cast<const bf16*>(a.k.p) + b * a.k.sb + hk * a.k.sh;
      GatherRows<D>(kt, kb, key >= 0 ? key * a.k.ss : -1, lane);
      CpAsyncWait();
      __syncwarp();
      const bf16* qh = qs + hk * kMaxGroup * KS;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < D / 16; kk += 2) {
        uint32_t r[4], af[4];
        LoadB2(r, qh, KS, kk * 16, lane);
        LoadA(af, kt, KS, kk * 16, lane);
        Mma(s, af, r[0], r[1]);
        LoadA(af, kt, KS, kk * 16 + 16, lane);
        Mma(s, af, r[2], r[3]);
      }
      __syncwarp();
      const float la = l2s[hk * kMaxGroup + 2 * c], lb = l2s[hk * kMaxGroup + 2 * c + 1];
      float p0 = (v0 ? exp2f(s[0] * sl2 - la) : 0.f) + (v0 ? exp2f(s[1] * sl2 - lb) : 0.f);
      float p1 = (v1 ? exp2f(s[2] * sl2 - la) : 0.f) + (v1 ? exp2f(s[3] * sl2 - lb) : 0.f);
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        p0 += __shfl_xor_sync(kFull, p0, o);
        p1 += __shfl_xor_sync(kFull, p1, o);
      }
      sum0 += p0, sum1 += p1;
    }
    if (c == 0) {
      if (j0 + g < a.W) pr[j0 + g] = sum0 * inv_h;
      if (j0 + g + 8 < a.W) pr[j0 + g + 8] = sum1 * inv_h;
    }
  }
}

dim3 QueryGrid(const SparseAttentionArgs& a) {
  return dim3(static_cast<unsigned>(a.S), static_cast<unsigned>(a.Hkv), static_cast<unsigned>(a.B));
}

}  // namespace

bool SparseAttentionMmaSupported(const SparseAttentionArgs& a) {
  return a.bf16 && (a.D == 64 || a.D == 128) && (a.Dv == 64 || a.Dv == 128) && a.Hkv > 0 && a.H % a.Hkv == 0 &&
         a.H / a.Hkv <= kMaxGroup;
}

int SparseAttentionForwardMma(const SparseAttentionArgs& a, SparseOutRows o, float* lse, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return ByDims(a, [&](auto d, auto dv) {
    ForwardMmaKernel<decltype(d)::value, decltype(dv)::value><<<QueryGrid(a), kThreads, 0, s>>>(a, o, lse);
    return cudaGetLastError();
  });
}

int SparseAttentionBackwardQueryMma(const SparseAttentionArgs& a, SparseRows dO, const float* lse, SparseOutRows dq,
                                    float* delta, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return ByDims(a, [&](auto d, auto dv) {
    BackwardQueryMmaKernel<decltype(d)::value, decltype(dv)::value>
        <<<QueryGrid(a), kThreads, 0, s>>>(a, dO, lse, dq, delta);
    return cudaGetLastError();
  });
}

int SparseAttentionBackwardKeysMma(const SparseAttentionArgs& a, SparseRows dO, const float* lse, const float* delta,
                                   const SparseKeyUnits& units, int64_t block_end, float* dk_acc, float* dv_acc,
                                   void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(block_end), static_cast<unsigned>(a.Hkv), static_cast<unsigned>(a.B));
  return ByDims(a, [&](auto d, auto dv) {
    BackwardKeysMmaKernel<decltype(d)::value, decltype(dv)::value>
        <<<grid, kThreads, 0, s>>>(a, dO, lse, delta, units, dk_acc, dv_acc);
    return cudaGetLastError();
  });
}

int SparseAttentionProbsMma(const SparseAttentionArgs& a, const float* lse, float* probs, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(a.S), static_cast<unsigned>(a.B));
  auto launch = [&](auto kernel, int d) {
    const size_t bytes = static_cast<size_t>(a.Hkv * kMaxGroup + kWarps * kRows) * (d + kPad) * sizeof(bf16) +
                         static_cast<size_t>(a.Hkv * kMaxGroup) * sizeof(float);
    if (bytes > 48 * 1024) {
      const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(bytes));
      if (e != cudaSuccess) return e;
    }
    kernel<<<grid, kThreads, bytes, s>>>(a, lse, probs);
    return cudaGetLastError();
  };
  return a.D == 64 ? launch(ProbsMmaKernel<64>, 64) : launch(ProbsMmaKernel<128>, 128);
}

}  // namespace odyssey::kernels::cuda
