// The lightning indexer's scores and top-k selection (see dsa_indexer.h).
//
// Scores: a block of 4 warps owns 64 queries x 128 items; a warp owns 32 of the items for all 64
// queries. The items' keys (128 x D bf16) are staged once through shared memory into each warp's
// registers as its mma B fragments (D / 16 k-steps x 4 n-tiles: 64 registers a lane at D = 128) and
// stay there for every index head. The queries of one head at a time (64 x D bf16) stream through
// three cp.async buffers, the next two heads' in flight while this one's products run (one barrier
// a head); a warp reads each head's A fragments by ldmatrix (rows padded by 16 bytes: row stride D
// + 8 elements, so 8 consecutive rows start in 8 different 16-byte bank groups and ldmatrix is
// conflict-free) and runs mma.sync m16n8k16 over two m-tiles at a time (8 independent accumulator
// chains). One ldmatrix feeds 4 mma (before: keys re-read from shared memory for every head, 72
// ldmatrix per 128 mma); shared memory holds the query buffers and the head weights (head-major, so
// the 8 rows a warp reads at once lie in 8 banks). Each head's products go relu, times w[t, j],
// into fp32 accumulators in registers; after the last head the block writes its tile of scores
// divided by sqrt(D) (the reference's order of operations, so exactly representable inputs give the
// reference's bits). A warp whose items no query of the block sees skips its products.
//
// Select: keys are the scores' bits made order-preserving as unsigned integers (-0 folded into
// +0, which compares equal to it); an item's composite (key << 32 | ~index) orders items by the
// rule. Two 8-bit radix passes over the row find the 16 high bits H of the top_k-th largest key
// and how many keys share them. Where at most kCandidates do (16 bits place a score within 1/128
// of an octave, so near the top_k-th of a long row that is tens to hundreds of keys), a third
// pass gathers the items above H and the composites of those sharing H; a bitonic sort of the
// latter in shared memory gives the first of them by the rule. Otherwise (ties: many equal
// scores) two more passes find the top_k-th largest key T itself and a last one gathers the
// items above T and, in index order, the first of those equal to T. A bitonic sort of the
// selection's composites orders it by the rule.
//
// A row is one block's, read at most five times from memory (three as a rule) with four 16-byte
// loads a thread in flight: at 1M+ tokens a chunk of the 256 MiB workspace holds ~128-256 rows,
// about one a multiprocessor, so the select's speed is that of a block streaming its row. The
// histograms are one a warp, and the lanes of a warp that fall in one bin count by one atomic
// (a row's keys crowd into a few bins of the first pass), so shared atomics do not serialize.
#include "kernels/cuda/dsa_indexer.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/mma.cuh"

namespace odyssey::kernels::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kQueries = 64;   // queries per score block
constexpr int kQueryBuffers = 3;  // heads of queries staged in shared memory
constexpr int kItems = static_cast<int>(kIndexerItemTile);  // items per score block
constexpr int kScoreThreads = 128;
constexpr int kSelectThreads = 512;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kLoads = 4;         // 16-byte loads a thread has in flight in a pass over a row
constexpr int kCandidates = 2048;  // keys sharing the 16-bit prefix that the select sorts itself
using mma::kFull;

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ldmatrix and the mma are mma.cuh's.
using mma::LdMatrix4;
using mma::Mma;

// Visible items of query t: item p covers tokens [pool p, pool p + pool - 1].
__device__ __forceinline__ int64_t VisibleItems(int64_t t, int64_t pool, int64_t P) {
  const int64_t n = (t + 1) / pool;
  return n < P ? n : P;
}

template <int D>
__global__ void __launch_bounds__(kScoreThreads, 2) ScoreKernel(IndexerChunk c) {
  constexpr int LD = D + 8;  // padded smem row, elements
  constexpr int kChunks = D / 8;  // 16-byte pieces of a row
  constexpr int KK = D / 16;      // k-steps of one product
  constexpr int kWarpItems = kItems / (kScoreThreads / 32);  // 32: the items a warp owns
  constexpr int NP = kWarpItems / 16;                        // pairs of 8-item n-tiles
  constexpr int MT = kQueries / 16;                          // 16-query m-tiles
  static_assert(kItems <= kQueryBuffers * kQueries, "the key tile is staged in the query buffers");
  static_assert(MT % 2 == 0, "m-tiles run in pairs");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);  // (kQueryBuffers, kQueries, LD); first the keys (kItems, LD)
  float* ws = reinterpret_cast<float*>(qs + kQueryBuffers * kQueries * LD);  // (HI, kQueries): a warp's 8 rows in 8 banks
  const int HI = static_cast<int>(c.HI);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kQueries;  // first row of the block (in the chunk)
  const int64_t last_row = min(r0 + kQueries, c.rows) - 1;
  const int64_t t_last = c.t0 + last_row;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kItems;
  const int64_t visible = VisibleItems(t_last, c.pool, c.P);
  if (i0 >= visible) return;  // no query of the block sees the tile
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // A warp whose items no query of the block sees skips its products (their scores are never read).
  const bool live = i0 + warp * kWarpItems < visible;

  // Keys of the tile (rows past the last item clamped: their scores are never read), staged in
  // the query buffers, then held in registers as the warp's B fragments for every head.
  const bf16* kg = static_cast<const bf16*>(c.k);
  for (int i = tid; i < kItems * kChunks; i += kScoreThreads) {
    const int row = i / kChunks, ch = i % kChunks;
    const int64_t item = min(i0 + row, c.P - 1);
    CpAsync16(qs + row * LD + ch * 8, kg + item * c.k_ss + ch * 8);
  }
  CpAsyncCommit();
  for (int i = tid; i < kQueries * HI; i += kScoreThreads) {
    const int row = i / HI, j = i % HI;
    ws[j * kQueries + row] = c.w[(c.t0 - c.q0 + min(r0 + row, last_row)) * c.HI + j];
  }
  CpAsyncWait<0>();
  __syncthreads();
  unsigned bk[KK][NP][4];
#pragma unroll
  for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
    for (int np = 0; np < NP; ++np) {
      // Matrix m = lane / 8: items n0 + (m / 2) * 8 + lane % 8, dims kk*16 + (m % 2) * 8.
      const int item = warp * kWarpItems + np * 16 + (lane / 16) * 8 + (lane % 8);
      LdMatrix4(bk[kk][np], qs + item * LD + kk * 16 + ((lane / 8) % 2) * 8);
    }
  }
  __syncthreads();  // every warp has its keys before the queries overwrite them

  const bf16* qg = static_cast<const bf16*>(c.q);
  auto stage_queries = [&](int head, int buf) {
    bf16* dst = qs + buf * kQueries * LD;
    for (int i = tid; i < kQueries * kChunks; i += kScoreThreads) {
      const int row = i / kChunks, ch = i % kChunks;
      const int64_t qrow = c.t0 - c.q0 + min(r0 + row, last_row);
      CpAsync16(dst + row * LD + ch * 8, qg + head * c.q_sh + qrow * c.q_ss + ch * 8);
    }
  };
  stage_queries(0, 0);
  CpAsyncCommit();
  if (HI > 1) {
    stage_queries(1, 1);
    CpAsyncCommit();
  }

  float acc[MT][2 * NP][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int n = 0; n < 2 * NP; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
    }
  }
  const int g = lane / 4;  // accumulator rows g and g + 8 of an m-tile
  // Three query buffers, two heads in flight: one barrier a head (after it, every warp is done
  // with the previous head's buffer, which the head after next fills).
  for (int head = 0; head < HI; ++head) {
    if (head + 1 < HI) {
      CpAsyncWait<1>();  // this head's group landed (the next one's may be in flight)
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    if (head + 2 < HI) {
      stage_queries(head + 2, (head + 2) % kQueryBuffers);
      CpAsyncCommit();
    }
    if (live) {
      const bf16* qb = qs + (head % kQueryBuffers) * kQueries * LD;
#pragma unroll
      for (int mp = 0; mp < MT; mp += 2) {  // two m-tiles at a time: 4 NP independent chains
        float s[2][2 * NP][4];
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
          for (int n = 0; n < 2 * NP; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[h2][n][e] = 0.f;
          }
        }
#pragma unroll
        for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            unsigned a[4];
            // Lanes 0-15: rows 0-15 of the m-tile at column kk*16; lanes 16-31: at kk*16 + 8.
            LdMatrix4(a, qb + ((mp + h2) * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
#pragma unroll
            for (int np = 0; np < NP; ++np) {
              Mma(s[h2][2 * np], a, bk[kk][np][0], bk[kk][np][1]);
              Mma(s[h2][2 * np + 1], a, bk[kk][np][2], bk[kk][np][3]);
            }
          }
        }
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int mrow = (mp + h2) * 16 + g;
          const float w0 = ws[head * kQueries + mrow], w1 = ws[head * kQueries + mrow + 8];
#pragma unroll
          for (int n = 0; n < 2 * NP; ++n) {
            acc[mp + h2][n][0] += w0 * fmaxf(s[h2][n][0], 0.f);
            acc[mp + h2][n][1] += w0 * fmaxf(s[h2][n][1], 0.f);
            acc[mp + h2][n][2] += w1 * fmaxf(s[h2][n][2], 0.f);
            acc[mp + h2][n][3] += w1 * fmaxf(s[h2][n][3], 0.f);
          }
        }
      }
    }
  }
  if (!live) return;
  const float sqrt_d = static_cast<float>(sqrt(static_cast<double>(D)));
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t row = r0 + m * 16 + g + hr * 8;
      if (row >= c.rows) continue;
      float* out = c.scores + row * c.ld + i0 + warp * kWarpItems + (lane % 4) * 2;
#pragma unroll
      for (int n = 0; n < 2 * NP; ++n) {
        *reinterpret_cast<float2*>(out + n * 8) =
            make_float2(acc[m][n][2 * hr] / sqrt_d, acc[m][n][2 * hr + 1] / sqrt_d);
      }
    }
  }
}

__device__ __forceinline__ unsigned OrderKey(float f) {
  const unsigned u = __float_as_uint(f == 0.f ? 0.f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// Larger is better: the key, then the lower index.
__device__ __forceinline__ unsigned long long Composite(unsigned key, int64_t item) {
  return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<unsigned>(item));
}

// Calls f(valid, i, key) for every item of a row's first n, in steps that every lane of the
// block runs (f may use warp collectives; `valid` is false past n). Each thread has kLoads
// 16-byte loads in flight before it uses any (ld is a multiple of 4, so the last group of four
// stays inside the row's storage).
template <typename F>
__device__ __forceinline__ void ForRow(const float* row, int64_t n, F&& f) {
  const int64_t n4 = (n + 3) / 4;
  for (int64_t base = 0; base < n4; base += int64_t{kLoads} * kSelectThreads) {
    float4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t i4 = base + u * kSelectThreads + threadIdx.x;
      v[u] = i4 < n4 ? reinterpret_cast<const float4*>(row)[i4] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t i = 4 * (base + u * kSelectThreads + threadIdx.x);
      f(i < n, i, OrderKey(v[u].x));
      f(i + 1 < n, i + 1, OrderKey(v[u].y));
      f(i + 2 < n, i + 2, OrderKey(v[u].z));
      f(i + 3 < n, i + 3, OrderKey(v[u].w));
    }
  }
}

// Adds one to h[bin] for each lane with `in` (every lane of the warp calls it). A row's keys
// crowd into a few bins (the first pass's 8 bits are the sign and 7 exponent bits), so shared
// atomics on one address from 32 lanes would serialize: two rounds let a leader add the count of
// every lane in its bin, the lanes left add one each.
__device__ __forceinline__ void CountInBin(unsigned* h, bool in, unsigned bin, int lane) {
  unsigned pending = __ballot_sync(kFull, in);
#pragma unroll
  for (int round = 0; round < 2; ++round) {
    if (pending == 0u) return;  // uniform: a ballot
    const int leader = __ffs(pending) - 1;
    const unsigned lb = __shfl_sync(kFull, bin, leader);
    const unsigned same = __ballot_sync(kFull, ((pending >> lane) & 1u) && bin == lb);
    if (lane == leader) atomicAdd(&h[lb], static_cast<unsigned>(__popc(same)));
    pending &= ~same;
  }
  if ((pending >> lane) & 1u) atomicAdd(&h[bin], 1u);
}

// Appends `x` at slots of *count for the lanes with `take` (every lane of the warp calls it): one
// atomic a warp.
__device__ __forceinline__ void Append(unsigned long long* out, unsigned* count, bool take, unsigned long long x,
                                       int lane) {
  const unsigned b = __ballot_sync(kFull, take);
  if (b == 0u) return;
  const int leader = __ffs(b) - 1;
  unsigned base = 0;
  if (lane == leader) base = atomicAdd(count, static_cast<unsigned>(__popc(b)));
  base = __shfl_sync(kFull, base, leader);
  if (take) out[base + __popc(b & ((1u << lane) - 1u))] = x;
}

// Bitonic sort of a[0, n) descending (n a power of two), by the block.
__device__ __forceinline__ void SortDescending(unsigned long long* a, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n; i += kSelectThreads) {
        const int j = i ^ stride;
        if (j > i) {
          const unsigned long long x = a[i], y = a[j];
          const bool descending = (i & size) == 0;
          if ((x < y) == descending) a[i] = y, a[j] = x;
        }
      }
      __syncthreads();
    }
  }
}

// Shared memory of the select kernel: the selection (kCap), the candidates (kCandidates), a
// histogram a warp and their sum.
template <int kCap>
constexpr size_t SelectSharedBytes() {
  return (kCap + kCandidates) * sizeof(unsigned long long) + (kSelectWarps + 1) * 256 * sizeof(unsigned);
}

template <int kCap>
__global__ void __launch_bounds__(kSelectThreads) SelectKernel(IndexerChunk c) {
  extern __shared__ __align__(16) unsigned char select_smem[];
  unsigned long long* const sel = reinterpret_cast<unsigned long long*>(select_smem);  // (kCap)
  unsigned long long* const cand = sel + kCap;                                       // (kCandidates)
  unsigned* const warp_hist = reinterpret_cast<unsigned*>(cand + kCandidates);       // (kSelectWarps, 256)
  unsigned* const hist = warp_hist + kSelectWarps * 256;                             // (256)
  __shared__ unsigned s_bin, s_remaining, s_count, s_gt, s_nc, s_eq_base;
  __shared__ unsigned warp_count[kSelectWarps];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t r = blockIdx.x;
  const int64_t t = c.t0 + r;
  const int64_t n = VisibleItems(t, c.pool, c.P);
  const int k = static_cast<int>(c.top_k);
  const float* row = c.scores + r * c.ld;
  int taken;
  if (n <= k) {
    for (int64_t i = tid; i < n; i += kSelectThreads) sel[i] = Composite(OrderKey(row[i]), i);
    taken = static_cast<int>(n);
  } else {
    unsigned prefix = 0, mask = 0, remaining = static_cast<unsigned>(k), count = 0;
    // One radix pass of 8 bits at `shift` over the keys under the prefix found so far.
    auto pass = [&](int shift) {
      for (int i = tid; i < (kSelectWarps + 1) * 256; i += kSelectThreads) warp_hist[i] = 0;
      __syncthreads();
      unsigned* const mine = warp_hist + warp * 256;
      ForRow(row, n, [&](bool valid, int64_t, unsigned key) {
        CountInBin(mine, valid && (key & mask) == prefix, (key >> shift) & 255u, lane);
      });
      __syncthreads();
      for (int b = tid; b < 256; b += kSelectThreads) {
        unsigned sum = 0;
        for (int w = 0; w < kSelectWarps; ++w) sum += warp_hist[w * 256 + b];
        hist[b] = sum;
      }
      __syncthreads();
      if (warp == 0) {
        // Lane l holds bins 8l .. 8l + 7; counts above a bin are those of higher bins.
        unsigned cnt[8], sum = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) sum += (cnt[e] = hist[lane * 8 + e]);
        unsigned suffix = sum;  // bins of lanes >= this one
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const unsigned v = __shfl_down_sync(kFull, suffix, off);
          if (lane + off < 32) suffix += v;
        }
        unsigned above = suffix - sum;
        if (above < remaining && remaining <= suffix) {
          for (int e = 7; e >= 0; --e) {
            if (above + cnt[e] >= remaining) {
              s_bin = lane * 8 + e;
              s_remaining = remaining - above;
              s_count = cnt[e];
              break;
            }
            above += cnt[e];
          }
        }
      }
      __syncthreads();
      prefix |= s_bin << shift;
      mask |= 255u << shift;
      remaining = s_remaining;
      count = s_count;
      __syncthreads();  // s_bin, s_remaining, s_count are rewritten by the next pass
    };
    pass(24);
    pass(16);
    // k - remaining keys lie above the 16-bit prefix, `count` >= remaining share it.
    if (tid == 0) s_gt = 0, s_nc = 0;
    __syncthreads();
    if (count <= static_cast<unsigned>(kCandidates)) {
      // Few share it (the usual case: 16 bits resolve a score to 1/128 of an octave): one more
      // pass takes the keys above it and those sharing it, and the rest runs in shared memory.
      ForRow(row, n, [&](bool valid, int64_t i, unsigned key) {
        const unsigned high = key & 0xffff0000u;
        const unsigned long long x = Composite(key, i);
        Append(sel, &s_gt, valid && high > prefix, x, lane);
        Append(cand, &s_nc, valid && high == prefix, x, lane);
      });
      __syncthreads();
      int m = 2;
      while (m < static_cast<int>(count)) m <<= 1;
      for (int i = static_cast<int>(count) + tid; i < m; i += kSelectThreads) cand[i] = 0ull;  // below every item
      __syncthreads();
      SortDescending(cand, m);
      const unsigned above = static_cast<unsigned>(k) - remaining;
      for (int i = tid; i < static_cast<int>(remaining); i += kSelectThreads) sel[above + i] = cand[i];
    } else {
      // Many share it (ties): the last two passes over the row, then the items above the
      // top_k-th largest key T and, in index order, the first `remaining` equal to it.
      pass(8);
      pass(0);
      const unsigned threshold = prefix;
      const unsigned above = static_cast<unsigned>(k) - remaining;
      if (tid == 0) s_eq_base = 0;
      __syncthreads();
      for (int64_t base = 0; base < n; base += kSelectThreads) {
        const int64_t i = base + tid;
        const unsigned key = i < n ? OrderKey(row[i]) : 0u;
        const bool gt = i < n && key > threshold, eq = i < n && key == threshold;
        Append(sel, &s_gt, gt, Composite(key, i), lane);
        const unsigned ballot = __ballot_sync(kFull, eq);
        if (lane == 0) warp_count[warp] = __popc(ballot);
        __syncthreads();
        unsigned pos = s_eq_base + __popc(ballot & ((1u << lane) - 1u));
        for (int w = 0; w < warp; ++w) pos += warp_count[w];
        if (eq && pos < remaining) sel[above + pos] = Composite(key, i);
        __syncthreads();
        if (tid == 0) {
          unsigned total = 0;
          for (int w = 0; w < kSelectWarps; ++w) total += warp_count[w];
          s_eq_base += total;
        }
        __syncthreads();
      }
    }
    taken = k;
  }
  for (int i = taken + tid; i < kCap; i += kSelectThreads) sel[i] = 0ull;  // below every item
  __syncthreads();
  SortDescending(sel, kCap);
  int32_t* out = c.out + (t - c.q0) * c.top_k;
  for (int i = tid; i < k; i += kSelectThreads) {
    out[i] = i < taken ? static_cast<int32_t>(0xffffffffu - static_cast<unsigned>(sel[i] & 0xffffffffull)) : -1;
  }
}

template <int D>
int LaunchScores(const IndexerChunk& c, cudaStream_t stream) {
  const size_t smem = kQueryBuffers * static_cast<size_t>(kQueries) * (D + 8) * sizeof(bf16) +
                      static_cast<size_t>(kQueries) * c.HI * sizeof(float);
  cudaError_t e = cudaFuncSetAttribute(ScoreKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return static_cast<int>(e);
  const dim3 grid(static_cast<unsigned>(c.ld / kItems), static_cast<unsigned>((c.rows + kQueries - 1) / kQueries));
  ScoreKernel<D><<<grid, kScoreThreads, smem, stream>>>(c);
  return static_cast<int>(cudaGetLastError());
}

template <int kCap>
int LaunchSelect(const IndexerChunk& c, cudaStream_t stream) {
  constexpr size_t smem = SelectSharedBytes<kCap>();
  cudaError_t e = cudaFuncSetAttribute(SelectKernel<kCap>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return static_cast<int>(e);
  SelectKernel<kCap><<<static_cast<unsigned>(c.rows), kSelectThreads, smem, stream>>>(c);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool IndexerSelectSupported(int64_t D, int64_t HI, int64_t top_k) {
  return (D == 64 || D == 128) && HI >= 1 && HI <= 64 && top_k >= 1 && top_k <= 4096;
}

int IndexerScores(const IndexerChunk& c, void* stream) {
  if (c.ld <= 0 || c.rows <= 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return c.D == 64 ? LaunchScores<64>(c, s) : LaunchScores<128>(c, s);
}

int IndexerSelect(const IndexerChunk& c, void* stream) {
  if (c.rows <= 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  if (c.top_k <= 256) return LaunchSelect<256>(c, s);
  if (c.top_k <= 512) return LaunchSelect<512>(c, s);
  if (c.top_k <= 1024) return LaunchSelect<1024>(c, s);
  if (c.top_k <= 2048) return LaunchSelect<2048>(c, s);
  return LaunchSelect<4096>(c, s);
}

}  // namespace odyssey::kernels::cuda
