// Sparse attention over selected keys (see sparse_attention.h): fp32 arithmetic on CUDA cores,
// fp32 or bf16 storage, 128 threads (four warps) a block.
//
// Two access patterns, shared by the three kernels:
//   - one item per lane: lane i takes the i-th of 32 selected keys (or pairs) and reads its whole
//     row, 16 bytes at a time, against vectors in shared memory (read by every lane at the same
//     address: a broadcast), for dot products without shuffles;
//   - lanes across the columns: for each of the 32 items in turn (its index and weight broadcast
//     by a shuffle), the warp reads the item's row once, coalesced, each lane D / 32 columns, and
//     accumulates a weighted sum into registers.
// Scores run in base 2: the queries (or the key) in shared memory carry scale * log2(e).
#include "kernels/cuda/sparse_attention.h"

#include <atomic>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/sparse_attention_mma.h"

namespace odyssey::kernels::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr unsigned kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// N consecutive elements (N in {2, 4, 8}) as fp32, in one access of 4 to 32 bytes.
template <int N>
__device__ __forceinline__ void Load(const float* p, float (&x)[N]) {
  if constexpr (N == 2) {
    const float2 a = *reinterpret_cast<const float2*>(p);
    x[0] = a.x, x[1] = a.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 a = *reinterpret_cast<const float4*>(p + i);
      x[i] = a.x, x[i + 1] = a.y, x[i + 2] = a.z, x[i + 3] = a.w;
    }
  }
}
template <int N>
__device__ __forceinline__ void Load(const bf16* p, float (&x)[N]) {
  static_assert(N == 2 || N == 4 || N == 8, "2, 4 or 8 elements");
  using Raw = typename std::conditional<N == 2, unsigned, typename std::conditional<N == 4, uint2, uint4>::type>::type;
  const Raw raw = *reinterpret_cast<const Raw*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    x[2 * i] = f.x, x[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(bf16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 FromF<bf16>(float x) { return __float2bfloat16(x); }

// sum_d row[d] * vec[d] over a whole row of global memory, vec in shared memory.
template <typename T, int D>
__device__ __forceinline__ float RowDot(const T* row, const float* vec) {
  float s = 0.f;
#pragma unroll 4
  for (int c = 0; c < D; c += 8) {
    float x[8];
    Load<8>(row + c, x);
#pragma unroll
    for (int e = 0; e < 8; ++e) s += x[e] * vec[c + e];
  }
  return s;
}
// The same against Gs vectors at once (vec[g * D + d]): one read of the row.
template <typename T, int D, int Gs>
__device__ __forceinline__ void RowDots(const T* row, const float* vec, float (&s)[Gs]) {
#pragma unroll
  for (int g = 0; g < Gs; ++g) s[g] = 0.f;
#pragma unroll 2
  for (int c = 0; c < D; c += 8) {
    float x[8];
    Load<8>(row + c, x);
#pragma unroll
    for (int g = 0; g < Gs; ++g) {
#pragma unroll
      for (int e = 0; e < 8; ++e) s[g] += x[e] * vec[g * D + c + e];
    }
  }
}

// Merges the four warps' (max, sum, acc) into the block's: warp w left m[w * Gs + g],
// l[w * Gs + g] and acc[(w * Gs + g) * Dv + d] in shared memory.
struct Merged {
  float m, l;
};
template <int Gs>
__device__ __forceinline__ Merged Merge(const float* m, const float* l, int g) {
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, m[w * Gs + g]);
  float L = 0.f;
  if (M > -INFINITY) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) L += l[w * Gs + g] * exp2f(m[w * Gs + g] - M);
  }
  return {M, L};
}

struct Grid {
  int64_t t, b;
  int h0, hk;  // the block's first head, its KV head
};
template <int Gs>
__device__ __forceinline__ Grid QueryBlock(const SparseAttentionArgs& a) {
  const int G = static_cast<int>(a.H / a.Hkv);
  const int h0 = blockIdx.y * Gs;
  return {static_cast<int64_t>(blockIdx.x), static_cast<int64_t>(blockIdx.z), h0, h0 / G};
}

// Loads Gs rows of heads h0.. at token t into shared memory (fp32, times mul).
template <typename T, int D, int Gs>
__device__ __forceinline__ void StageRows(float* dst, const SparseRows& r, int64_t b, int h0, int64_t t, float mul) {
  const T* p = static_cast<const T*>(r.p) + b * r.sb + t * r.ss;
  for (int i = threadIdx.x; i < Gs * D; i += kThreads) {
    const int g = i / D, d = i - g * D;
    dst[i] = ToF(p[(h0 + g) * r.sh + d]) * mul;
  }
}

template <typename T, int D, int Dv, int Gs>
__global__ void __launch_bounds__(kThreads) ForwardKernel(SparseAttentionArgs a, SparseOutRows out, float* lse) {
  constexpr int kV = Dv / 32;
  __shared__ float qs[Gs * D];
  __shared__ float red_m[kWarps * Gs], red_l[kWarps * Gs];
  __shared__ float red_o[kWarps * Gs * Dv];
  const Grid at = QueryBlock<Gs>(a);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  StageRows<T, D, Gs>(qs, a.q, at.b, at.h0, at.t, a.scale * kLog2e);
  __syncthreads();
  const T* kb = static_cast<const T*>(a.k.p) + at.b * a.k.sb + at.hk * a.k.sh;
  const T* vb = static_cast<const T*>(a.v.p) + at.b * a.v.sb + at.hk * a.v.sh + lane * kV;
  const int32_t* ir = a.idx + (at.b * a.S + at.t) * a.W;
  float m[Gs], l[Gs], acc[Gs][kV];
#pragma unroll
  for (int g = 0; g < Gs; ++g) {
    m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kV; ++i) acc[g][i] = 0.f;
  }
  for (int64_t base = warp * 32; base < a.W; base += kThreads) {
    const int64_t j = base + lane;
    const int key = j < a.W ? ir[j] : -1;
    if (__all_sync(kFull, key < 0)) continue;
    float s[Gs];
    if (key >= 0) {
      RowDots<T, D, Gs>(kb + key * a.k.ss, qs, s);
    } else {
#pragma unroll
      for (int g = 0; g < Gs; ++g) s[g] = -INFINITY;
    }
    float p[Gs];
#pragma unroll
    for (int g = 0; g < Gs; ++g) {
      const float mn = fmaxf(m[g], WarpMax(s[g]));  // finite: some lane holds a key
      const float corr = exp2f(m[g] - mn);
      p[g] = exp2f(s[g] - mn);
      l[g] = l[g] * corr + WarpSum(p[g]);
      m[g] = mn;
#pragma unroll
      for (int i = 0; i < kV; ++i) acc[g][i] *= corr;
    }
    for (int kk = 0; kk < 32; ++kk) {
      const int kkey = __shfl_sync(kFull, key, kk);
      if (kkey < 0) continue;
      float y[kV];
      Load<kV>(vb + kkey * a.v.ss, y);
#pragma unroll
      for (int g = 0; g < Gs; ++g) {
        const float pg = __shfl_sync(kFull, p[g], kk);
#pragma unroll
        for (int i = 0; i < kV; ++i) acc[g][i] += pg * y[i];
      }
    }
  }
#pragma unroll
  for (int g = 0; g < Gs; ++g) {
    if (lane == 0) red_m[warp * Gs + g] = m[g], red_l[warp * Gs + g] = l[g];
#pragma unroll
    for (int i = 0; i < kV; ++i) red_o[(warp * Gs + g) * Dv + lane * kV + i] = acc[g][i];
  }
  __syncthreads();
  T* ob = static_cast<T*>(out.p) + at.b * out.sb + at.t * out.ss;
  for (int i = threadIdx.x; i < Gs * Dv; i += kThreads) {
    const int g = i / Dv, d = i - g * Dv;
    const Merged r = Merge<Gs>(red_m, red_l, g);
    float o = 0.f;
    if (r.l > 0.f) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) o += red_o[(w * Gs + g) * Dv + d] * exp2f(red_m[w * Gs + g] - r.m);
      o /= r.l;
    }
    ob[(at.h0 + g) * out.sh + d] = FromF<T>(o);
    if (d == 0) lse[(at.b * a.H + at.h0 + g) * a.S + at.t] = r.l > 0.f ? (r.m + log2f(r.l)) / kLog2e : -INFINITY;
  }
}

// dq = scale sum_j p_j (dp_j - delta) k_j with dp_j = dO . v_j and delta = sum_j p_j dp_j (= dO . o,
// here in fp32 from the recomputed p rather than from the rounded o): one walk over the keys
// accumulates A = sum_j p_j dp_j k_j, Bk = sum_j p_j k_j and delta, then dq = scale (A - delta Bk).
template <typename T, int D, int Dv, int Gs>
__global__ void __launch_bounds__(kThreads)
    BackwardQueryKernel(SparseAttentionArgs a, SparseRows dO, const float* lse, SparseOutRows dq, float* delta) {
  constexpr int kD = D / 32;
  __shared__ float qs[Gs * D], dos[Gs * Dv];
  __shared__ float lse2[Gs], red_delta[kWarps * Gs];
  __shared__ float red[2 * kWarps * Gs * D];
  const Grid at = QueryBlock<Gs>(a);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  StageRows<T, D, Gs>(qs, a.q, at.b, at.h0, at.t, a.scale * kLog2e);
  StageRows<T, Dv, Gs>(dos, dO, at.b, at.h0, at.t, 1.f);
  if (threadIdx.x < Gs) lse2[threadIdx.x] = lse[(at.b * a.H + at.h0 + threadIdx.x) * a.S + at.t] * kLog2e;
  __syncthreads();
  const T* kb = static_cast<const T*>(a.k.p) + at.b * a.k.sb + at.hk * a.k.sh;
  const T* vb = static_cast<const T*>(a.v.p) + at.b * a.v.sb + at.hk * a.v.sh;
  const int32_t* ir = a.idx + (at.b * a.S + at.t) * a.W;
  float acc_a[Gs][kD], acc_b[Gs][kD], dlt[Gs];
#pragma unroll
  for (int g = 0; g < Gs; ++g) {
    dlt[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kD; ++i) acc_a[g][i] = 0.f, acc_b[g][i] = 0.f;
  }
  for (int64_t base = warp * 32; base < a.W; base += kThreads) {
    const int64_t j = base + lane;
    const int key = j < a.W ? ir[j] : -1;
    if (__all_sync(kFull, key < 0)) continue;
    float p[Gs], pdp[Gs];
    if (key >= 0) {
      float s[Gs], dp[Gs];
      RowDots<T, D, Gs>(kb + key * a.k.ss, qs, s);
      RowDots<T, Dv, Gs>(vb + key * a.v.ss, dos, dp);
#pragma unroll
      for (int g = 0; g < Gs; ++g) p[g] = exp2f(s[g] - lse2[g]), pdp[g] = p[g] * dp[g], dlt[g] += pdp[g];
    } else {
#pragma unroll
      for (int g = 0; g < Gs; ++g) p[g] = 0.f, pdp[g] = 0.f;
    }
    for (int kk = 0; kk < 32; ++kk) {
      const int kkey = __shfl_sync(kFull, key, kk);
      if (kkey < 0) continue;
      float y[kD];
      Load<kD>(kb + kkey * a.k.ss + lane * kD, y);
#pragma unroll
      for (int g = 0; g < Gs; ++g) {
        const float wa = __shfl_sync(kFull, pdp[g], kk), wb = __shfl_sync(kFull, p[g], kk);
#pragma unroll
        for (int i = 0; i < kD; ++i) acc_a[g][i] += wa * y[i], acc_b[g][i] += wb * y[i];
      }
    }
  }
#pragma unroll
  for (int g = 0; g < Gs; ++g) {
    const float d = WarpSum(dlt[g]);
    if (lane == 0) red_delta[warp * Gs + g] = d;
#pragma unroll
    for (int i = 0; i < kD; ++i) {
      red[(warp * Gs + g) * D + lane * kD + i] = acc_a[g][i];
      red[(kWarps * Gs + warp * Gs + g) * D + lane * kD + i] = acc_b[g][i];
    }
  }
  __syncthreads();
  T* qb = static_cast<T*>(dq.p) + at.b * dq.sb + at.t * dq.ss;
  for (int i = threadIdx.x; i < Gs * D; i += kThreads) {
    const int g = i / D, d = i - g * D;
    float sa = 0.f, sb = 0.f, dl = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      sa += red[(w * Gs + g) * D + d];
      sb += red[(kWarps * Gs + w * Gs + g) * D + d];
      dl += red_delta[w * Gs + g];
    }
    qb[(at.h0 + g) * dq.sh + d] = FromF<T>((sa - dl * sb) * a.scale);
    if (d == 0) delta[(at.b * a.H + at.h0 + g) * a.S + at.t] = dl;
  }
}

// Key side, one block per (aligned block of kKeys keys, KV head) over the block's units: a unit
// is one query's run of entries in the block (see sparse_attention.h), so each query row q_t and
// dO_t is read once for up to kKeys keys (a pool of four under DSA's pool selection) instead of
// once per key. One unit per lane for the scores (the rows against the block's keys in shared
// memory), then lanes across the columns for the sums, as the other kernels. The units come in a
// fixed order and each thread owns fixed columns: deterministic, no atomics.
constexpr int kKeys = kSparseKeyBlock;

template <typename T, int D, int Dv>
__global__ void __launch_bounds__(kThreads)
    BackwardKeysKernel(SparseAttentionArgs a, SparseRows dO, const float* lse, const float* delta,
                       SparseKeyUnits u, float* dk_acc, float* dv_acc) {
  constexpr int kD = D / 32, kV = Dv / 32;
  const int64_t blk = blockIdx.x, b = blockIdx.z;
  const int hk = blockIdx.y;
  const int64_t nb = (a.Sk + kKeys - 1) / kKeys;
  const int64_t lo = u.offsets[b * nb + blk], hi = u.offsets[b * nb + blk + 1];
  if (lo == hi) return;
  __shared__ float ks[kKeys * D], vs[kKeys * Dv];
  __shared__ float red[kWarps * kKeys * (D + Dv)];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  {
    const T* kb = static_cast<const T*>(a.k.p) + b * a.k.sb + hk * a.k.sh;
    const T* vb = static_cast<const T*>(a.v.p) + b * a.v.sb + hk * a.v.sh;
    for (int i = threadIdx.x; i < kKeys * D; i += kThreads) {
      const int64_t key = blk * kKeys + i / D;
      ks[i] = key < a.Sk ? ToF(kb[key * a.k.ss + i % D]) * (a.scale * kLog2e) : 0.f;
    }
    for (int i = threadIdx.x; i < kKeys * Dv; i += kThreads) {
      const int64_t key = blk * kKeys + i / Dv;
      vs[i] = key < a.Sk ? ToF(vb[key * a.v.ss + i % Dv]) : 0.f;
    }
  }
  __syncthreads();
  const int G = static_cast<int>(a.H / a.Hkv);
  float dk[kKeys][kD], dv[kKeys][kV];
#pragma unroll
  for (int s = 0; s < kKeys; ++s) {
#pragma unroll
    for (int i = 0; i < kD; ++i) dk[s][i] = 0.f;
#pragma unroll
    for (int i = 0; i < kV; ++i) dv[s][i] = 0.f;
  }
  for (int64_t base = lo + warp * 32; base < hi; base += kThreads) {
    int t = -1;
    unsigned mask = 0;
    if (base + lane < hi) {
      const int64_t e = u.first[base + lane];  // (b * rows + t - t0) * W + w
      const int64_t row = e / a.W, w0 = e - row * a.W;
      t = static_cast<int>(row - b * u.rows + u.t0);
      const int32_t* ir = a.idx + (b * a.S + t) * a.W;
      int prev = -1;
      for (int64_t w = w0; w < a.W && w < w0 + kKeys; ++w) {
        const int key = ir[w];
        if (key < 0 || key / kKeys != blk || key <= prev) break;
        mask |= 1u << (key % kKeys);
        prev = key;
      }
    }
    for (int g = 0; g < G; ++g) {
      const int h = hk * G + g;
      const T* qh = static_cast<const T*>(a.q.p) + b * a.q.sb + h * a.q.sh;
      const T* dh = static_cast<const T*>(dO.p) + b * dO.sb + h * dO.sh;
      float p[kKeys], ds[kKeys];
#pragma unroll
      for (int s = 0; s < kKeys; ++s) p[s] = 0.f, ds[s] = 0.f;
      if (t >= 0) {
        const int64_t row = (b * a.H + h) * a.S + t;
        float sc[kKeys], dp[kKeys];
        RowDots<T, D, kKeys>(qh + t * a.q.ss, ks, sc);
        RowDots<T, Dv, kKeys>(dh + t * dO.ss, vs, dp);
        const float l2 = lse[row] * kLog2e, dl = delta[row];
#pragma unroll
        for (int s = 0; s < kKeys; ++s) {
          if ((mask >> s) & 1u) p[s] = exp2f(sc[s] - l2), ds[s] = p[s] * (dp[s] - dl);
        }
      }
      for (int kk = 0; kk < 32; ++kk) {
        const int tt = __shfl_sync(kFull, t, kk);
        if (tt < 0) continue;
        float pk[kKeys], dsk[kKeys];
#pragma unroll
        for (int s = 0; s < kKeys; ++s) pk[s] = __shfl_sync(kFull, p[s], kk), dsk[s] = __shfl_sync(kFull, ds[s], kk);
        float x[kD], y[kV];
        Load<kD>(qh + tt * a.q.ss + lane * kD, x);
        Load<kV>(dh + tt * dO.ss + lane * kV, y);
#pragma unroll
        for (int s = 0; s < kKeys; ++s) {
#pragma unroll
          for (int i = 0; i < kD; ++i) dk[s][i] += dsk[s] * x[i];
#pragma unroll
          for (int i = 0; i < kV; ++i) dv[s][i] += pk[s] * y[i];
        }
      }
    }
  }
#pragma unroll
  for (int s = 0; s < kKeys; ++s) {
    float* r = red + (warp * kKeys + s) * (D + Dv);
#pragma unroll
    for (int i = 0; i < kD; ++i) r[lane * kD + i] = dk[s][i];
#pragma unroll
    for (int i = 0; i < kV; ++i) r[D + lane * kV + i] = dv[s][i];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kKeys * (D + Dv); i += kThreads) {
    const int s = i / (D + Dv), c = i - s * (D + Dv);
    const int64_t key = blk * kKeys + s;
    if (key >= a.Sk) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[(w * kKeys + s) * (D + Dv) + c];
    if (c < D) {
      dk_acc[((b * a.Hkv + hk) * a.Sk + key) * D + c] += sum * a.scale;
    } else {
      dv_acc[((b * a.Hkv + hk) * a.Sk + key) * Dv + c - D] += sum;
    }
  }
}

int HeadGroup(int64_t G) {
  for (int gs : {4, 3, 2}) {
    if (G % gs == 0) return gs;
  }
  return 1;
}

// Calls f(T{}, D-constant, Dv-constant, Gs-constant) for the run-time shape.
// Head-mean probabilities at the selected keys (SparseAttentionProbs): one block per (token,
// batch row), the heads in groups of Gs sharing a KV head, one group after another. Per group two
// walks over the selection: the log-sum-exp (lane-local online max and sum, merged over lanes and
// warps; or read from lse_in, the forward's, and the walk skipped), then each key's probability
// summed over the group's heads into probs. A key is always
// handled by the same thread (lane and warp by its position), which adds the groups' shares to
// its own entry in a fixed order: deterministic, no atomics.
__device__ __forceinline__ void MergeMaxSum(float& m, float& l, float om, float ol) {
  const float mn = fmaxf(m, om);
  if (mn == -INFINITY) return;
  l = (m == -INFINITY ? 0.f : l * exp2f(m - mn)) + (om == -INFINITY ? 0.f : ol * exp2f(om - mn));
  m = mn;
}

template <typename T, int D, int Gs>
__global__ void __launch_bounds__(kThreads) ProbsKernel(SparseAttentionArgs a, const float* lse_in, float* probs) {
  __shared__ float qs[Gs * D];
  __shared__ float red_m[kWarps * Gs], red_l[kWarps * Gs];
  const int64_t t = blockIdx.x, b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int G = static_cast<int>(a.H / a.Hkv);
  const int32_t* ir = a.idx + (b * a.S + t) * a.W;
  float* pr = probs + (b * a.S + t) * a.W;
  const float inv_h = 1.f / static_cast<float>(a.H);
  for (int h0 = 0; h0 < a.H; h0 += Gs) {
    __syncthreads();  // the previous group's qs and red_* are no longer read
    StageRows<T, D, Gs>(qs, a.q, b, h0, t, a.scale * kLog2e);
    __syncthreads();
    const T* kb = static_cast<const T*>(a.k.p) + b * a.k.sb + (h0 / G) * a.k.sh;
    float lse[Gs];
    if (lse_in != nullptr) {  // uniform over the block
#pragma unroll
      for (int g = 0; g < Gs; ++g) lse[g] = lse_in[(b * a.H + h0 + g) * a.S + t] * kLog2e;  // -inf stays -inf
    } else {
      float m[Gs], l[Gs];
#pragma unroll
      for (int g = 0; g < Gs; ++g) m[g] = -INFINITY, l[g] = 0.f;
      for (int64_t j = warp * 32 + lane; j < a.W; j += kThreads) {
        const int key = ir[j];
        if (key < 0) continue;
        float s[Gs];
        RowDots<T, D, Gs>(kb + key * a.k.ss, qs, s);
#pragma unroll
        for (int g = 0; g < Gs; ++g) MergeMaxSum(m[g], l[g], s[g], 1.f);
      }
#pragma unroll
      for (int g = 0; g < Gs; ++g) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          const float om = __shfl_xor_sync(kFull, m[g], off), ol = __shfl_xor_sync(kFull, l[g], off);
          MergeMaxSum(m[g], l[g], om, ol);
        }
        if (lane == 0) red_m[warp * Gs + g] = m[g], red_l[warp * Gs + g] = l[g];
      }
      __syncthreads();
#pragma unroll
      for (int g = 0; g < Gs; ++g) {
        const Merged r = Merge<Gs>(red_m, red_l, g);
        lse[g] = r.l > 0.f ? r.m + log2f(r.l) : -INFINITY;
      }
    }
    const bool last = h0 + Gs >= a.H;
    for (int64_t j = warp * 32 + lane; j < a.W; j += kThreads) {
      const int key = ir[j];
      float p = 0.f;
      if (key >= 0) {
        float s[Gs];
        RowDots<T, D, Gs>(kb + key * a.k.ss, qs, s);
#pragma unroll
        for (int g = 0; g < Gs; ++g) {
          if (lse[g] > -INFINITY) p += exp2f(s[g] - lse[g]);
        }
      }
      p += h0 == 0 ? 0.f : pr[j];
      pr[j] = last ? p * inv_h : p;
    }
  }
}

template <typename F>
cudaError_t Dispatch(const SparseAttentionArgs& a, F&& f) {
  auto by_gs = [&](auto t, auto d, auto dv) {
    switch (HeadGroup(a.H / a.Hkv)) {
      case 4: return f(t, d, dv, std::integral_constant<int, 4>{});
      case 3: return f(t, d, dv, std::integral_constant<int, 3>{});
      case 2: return f(t, d, dv, std::integral_constant<int, 2>{});
      default: return f(t, d, dv, std::integral_constant<int, 1>{});
    }
  };
  auto by_dims = [&](auto t) { return ByDims(a, [&](auto d, auto dv) { return by_gs(t, d, dv); }); };
  return a.bf16 ? by_dims(bf16{}) : by_dims(float{});
}

dim3 QueryGrid(const SparseAttentionArgs& a) {
  return dim3(static_cast<unsigned>(a.S), static_cast<unsigned>(a.H / HeadGroup(a.H / a.Hkv)),
              static_cast<unsigned>(a.B));
}

}  // namespace

bool SparseAttentionSupported(int64_t D, int64_t Dv) { return (D == 64 || D == 128) && (Dv == 64 || Dv == 128); }

namespace {
std::atomic<bool> tensor_cores{true};
std::atomic<int64_t> mma_launches{0};
bool UseMma(const SparseAttentionArgs& a) {
  const bool use = tensor_cores.load() && SparseAttentionMmaSupported(a);
  if (use) mma_launches.fetch_add(1);
  return use;
}
}  // namespace

int64_t SparseAttentionTensorCoreLaunches() { return mma_launches.load(); }

void SetSparseAttentionTensorCores(bool enabled) { tensor_cores.store(enabled); }
bool SparseAttentionTensorCores() { return tensor_cores.load(); }

int SparseAttentionForward(const SparseAttentionArgs& a, SparseOutRows o, float* lse, void* stream) {
  if (a.S == 0 || a.B == 0) return cudaSuccess;
  if (UseMma(a)) return SparseAttentionForwardMma(a, o, lse, stream);
  auto s = static_cast<cudaStream_t>(stream);
  return Dispatch(a, [&](auto t, auto d, auto dv, auto gs) {
    ForwardKernel<decltype(t), decltype(d)::value, decltype(dv)::value, decltype(gs)::value>
        <<<QueryGrid(a), kThreads, 0, s>>>(a, o, lse);
    return cudaGetLastError();
  });
}

int SparseAttentionProbs(const SparseAttentionArgs& a, const float* lse, float* probs, void* stream) {
  if (a.S == 0 || a.B == 0 || a.W == 0) return cudaSuccess;
  // (The tensor-core kernel stages every head's query in shared memory: up to 64 KV heads.)
  if (lse != nullptr && a.Hkv <= 64 && UseMma(a)) return SparseAttentionProbsMma(a, lse, probs, stream);
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(a.S), static_cast<unsigned>(a.B));
  return Dispatch(a, [&](auto t, auto d, auto, auto gs) {
    ProbsKernel<decltype(t), decltype(d)::value, decltype(gs)::value><<<grid, kThreads, 0, s>>>(a, lse, probs);
    return cudaGetLastError();
  });
}

int SparseAttentionBackwardQuery(const SparseAttentionArgs& a, SparseRows dO, const float* lse, SparseOutRows dq,
                                 float* delta, void* stream) {
  if (a.S == 0 || a.B == 0) return cudaSuccess;
  if (UseMma(a)) return SparseAttentionBackwardQueryMma(a, dO, lse, dq, delta, stream);
  auto s = static_cast<cudaStream_t>(stream);
  return Dispatch(a, [&](auto t, auto d, auto dv, auto gs) {
    BackwardQueryKernel<decltype(t), decltype(d)::value, decltype(dv)::value, decltype(gs)::value>
        <<<QueryGrid(a), kThreads, 0, s>>>(a, dO, lse, dq, delta);
    return cudaGetLastError();
  });
}

int SparseAttentionBackwardKeys(const SparseAttentionArgs& a, SparseRows dO, const float* lse, const float* delta,
                                const SparseKeyUnits& units, int64_t block_end, float* dk_acc, float* dv_acc,
                                void* stream) {
  if (block_end <= 0 || a.B == 0) return cudaSuccess;
  if (UseMma(a)) return SparseAttentionBackwardKeysMma(a, dO, lse, delta, units, block_end, dk_acc, dv_acc, stream);
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(block_end), static_cast<unsigned>(a.Hkv), static_cast<unsigned>(a.B));
  return Dispatch(a, [&](auto t, auto d, auto dv, auto) {
    BackwardKeysKernel<decltype(t), decltype(d)::value, decltype(dv)::value>
        <<<grid, kThreads, 0, s>>>(a, dO, lse, delta, units, dk_acc, dv_acc);
    return cudaGetLastError();
  });
}

}  // namespace odyssey::kernels::cuda
