// The indexer KL over the selected pools (see indexer_kl.h): one block per query row.
#include "kernels/cuda/indexer_kl.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/mma.cuh"

namespace odyssey::kernels::cuda {
namespace {

using namespace mma;  // NOLINT(build/namespaces): the fragment helpers of mma.cuh

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 16;     // pools a step
constexpr int kHeads = 32;     // heads a block holds (8 a warp), HI <= 32
constexpr int kHStride = kHeads + kPad;  // the [pool][head] ddots tiles

// The shared memory of a block (dynamic: the logits take kp floats).
template <int DI>
struct Smem {
  static constexpr int kQS = DI + kPad;
  bf16* q;        // [kHeads][kQS]: the row's queries, zero rows past HI
  bf16* keys;     // [kChunk][kQS]: a chunk's pooled keys
  bf16* dd_hi;    // [kChunk][kHStride]: ddots, high part (backward)
  bf16* dd_lo;    // [kChunk][kHStride]: ddots, remainder
  float* w;       // [kHeads]: head weights, 0 past HI
  float* part;    // [kWarps][kChunk]: the warps' shares of a chunk's logits
  float* red;     // [kWarps * 2]: block reductions
  float* logits;  // [kp]: logits, then (backward) dlog
  static size_t Bytes(int64_t kp) {
    return static_cast<size_t>(kHeads * kQS + kChunk * kQS + 2 * kChunk * kHStride) * sizeof(bf16) +
           static_cast<size_t>(kHeads + kWarps * kChunk + kWarps * 2 + kp) * sizeof(float);
  }
  __device__ explicit Smem(unsigned char* raw) {
    q = reinterpret_cast<bf16*>(raw);
    keys = q + kHeads * kQS;
    dd_hi = keys + kChunk * kQS;
    dd_lo = dd_hi + kChunk * kHStride;
    w = reinterpret_cast<float*>(dd_lo + kChunk * kHStride);
    part = w + kHeads;
    red = part + kWarps * kChunk;
    logits = red + kWarps * 2;
  }
};

// Stages the row's queries and head weights.
template <int DI>
__device__ void StageRow(const Smem<DI>& sm, const IndexerKlArgs& a, int64_t b, int64_t t) {
  const bf16* qp = static_cast<const bf16*>(a.q) + b * a.q_sb + t * a.q_ss;
  for (int i = threadIdx.x; i < kHeads * DI; i += kThreads) {
    const int h = i / DI, d = i - h * DI;
    sm.q[h * Smem<DI>::kQS + d] = h < a.HI ? qp[h * a.q_sh + d] : __float2bfloat16(0.f);
  }
  const bf16* wp = static_cast<const bf16*>(a.w) + (b * a.S + t) * a.HI;
  for (int h = threadIdx.x; h < kHeads; h += kThreads) sm.w[h] = h < a.HI ? __bfloat162float(wp[h]) : 0.f;
}

// Gathers chunk c's pooled keys (zeros for -1 and past kp) with every thread of the block.
template <int DI>
__device__ void GatherChunk(const Smem<DI>& sm, const IndexerKlArgs& a, const int32_t* pools, int64_t c0,
                            const bf16* kb) {
  constexpr int kChunks = DI / 8;  // 16-byte pieces a row
  for (int x = threadIdx.x; x < kChunk * kChunks; x += kThreads) {
    const int i = x / kChunks, ch = x % kChunks;
    const int64_t j = c0 + i;
    const int pool = j < a.kp ? pools[j] : -1;
    CpAsync16(sm.keys + i * Smem<DI>::kQS + ch * 8, pool >= 0 ? kb + pool * a.k_sp + ch * 8 : kb, pool >= 0);
  }
  CpAsyncWait();
}

// Warp w's dots of the chunk: S (16 pools x its 8 heads), C layout (pools g, g + 8; heads
// 8w + 2c, + 1).
template <int DI>
__device__ __forceinline__ void ChunkDots(const Smem<DI>& sm, int warp, int lane, float (&s)[4]) {
  s[0] = s[1] = s[2] = s[3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < DI / 16; kk += 2) {
    uint32_t b[4], af[4];
    LoadB2(b, sm.q + warp * 8 * Smem<DI>::kQS, Smem<DI>::kQS, kk * 16, lane);
    LoadA(af, sm.keys, Smem<DI>::kQS, kk * 16, lane);
    Mma(s, af, b[0], b[1]);
    LoadA(af, sm.keys, Smem<DI>::kQS, kk * 16 + 16, lane);
    Mma(s, af, b[2], b[3]);
  }
}

// Sums v over the block (every thread calls it; all get the sum).
__device__ __forceinline__ float BlockSum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w];
  return s;
}
__device__ __forceinline__ float BlockMax(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[kWarps + threadIdx.x / 32] = v;
  __syncthreads();
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, red[kWarps + w]);
  return m;
}

// The row's logits into sm.logits (every valid pool; -1 entries get 0, as MaskedLogSoftmax's
// rows do) and its log-sum-exp over the valid pools (-inf without one).
template <int DI>
__device__ float RowLogits(const Smem<DI>& sm, const IndexerKlArgs& a, const int32_t* pools, const bf16* kb) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const float inv_sqrt = rsqrtf(static_cast<float>(a.DI));
  for (int64_t c0 = 0; c0 < a.kp; c0 += kChunk) {
    GatherChunk<DI>(sm, a, pools, c0, kb);
    __syncthreads();
    float s[4];
    ChunkDots<DI>(sm, warp, lane, s);
    const float w0 = sm.w[warp * 8 + 2 * c], w1 = sm.w[warp * 8 + 2 * c + 1];
    float p0 = fmaxf(s[0], 0.f) * w0 + fmaxf(s[1], 0.f) * w1;  // pool g
    float p1 = fmaxf(s[2], 0.f) * w0 + fmaxf(s[3], 0.f) * w1;  // pool g + 8
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      p0 += __shfl_xor_sync(kFull, p0, o);
      p1 += __shfl_xor_sync(kFull, p1, o);
    }
    if (c == 0) sm.part[warp * kChunk + g] = p0, sm.part[warp * kChunk + g + 8] = p1;
    __syncthreads();  // the chunk's keys are read, its parts written
    if (threadIdx.x < kChunk && c0 + threadIdx.x < a.kp) {
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) l += sm.part[w * kChunk + threadIdx.x];
      sm.logits[c0 + threadIdx.x] = pools[c0 + threadIdx.x] >= 0 ? l * inv_sqrt : 0.f;
    }
  }
  __syncthreads();
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < a.kp; j += kThreads) {
    if (pools[j] >= 0) m = fmaxf(m, sm.logits[j]);
  }
  m = BlockMax(m, sm.red);
  if (m == -INFINITY) return -INFINITY;
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < a.kp; j += kThreads) {
    if (pools[j] >= 0) sum += expf(sm.logits[j] - m);
  }
  return m + logf(BlockSum(sum, sm.red));
}

template <int DI>
__global__ void __launch_bounds__(kThreads) ForwardKernel(IndexerKlArgs a, float* kl_rows) {
  extern __shared__ __align__(16) unsigned char raw[];
  const Smem<DI> sm(raw);
  const int64_t t = blockIdx.x, b = blockIdx.y;
  const int32_t* pools = a.pool + (b * a.S + t) * a.kp;
  const float* target = a.target + (b * a.S + t) * a.kp;
  const bf16* kb = static_cast<const bf16*>(a.k) + b * a.k_sb;
  StageRow<DI>(sm, a, b, t);
  __syncthreads();
  const float lse = RowLogits<DI>(sm, a, pools, kb);
  float kl = 0.f;
  if (lse > -INFINITY) {
    for (int64_t j = threadIdx.x; j < a.kp; j += kThreads) {
      const float tg = target[j];
      if (pools[j] >= 0 && tg > 0.f) kl += tg * (logf(tg) - (sm.logits[j] - lse));
    }
  }
  kl = BlockSum(kl, sm.red);  // every thread takes part (lse is uniform over the block)
  if (threadIdx.x == 0) kl_rows[b * a.S + t] = lse > -INFINITY ? kl : 0.f;
}

template <int DI>
__global__ void __launch_bounds__(kThreads)
    BackwardKernel(IndexerKlArgs a, const float* g_in, bf16* dq, bf16* dw, float* dk_acc) {
  constexpr int QS = Smem<DI>::kQS;
  extern __shared__ __align__(16) unsigned char raw[];
  const Smem<DI> sm(raw);
  const int64_t t = blockIdx.x, b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int32_t* pools = a.pool + (b * a.S + t) * a.kp;
  const float* target = a.target + (b * a.S + t) * a.kp;
  const bf16* kb = static_cast<const bf16*>(a.k) + b * a.k_sb;
  StageRow<DI>(sm, a, b, t);
  __syncthreads();
  const float lse = RowLogits<DI>(sm, a, pools, kb);
  // dlog over the valid pools (0 elsewhere and in a row without one), into sm.logits.
  float ts = 0.f;
  for (int64_t j = threadIdx.x; j < a.kp; j += kThreads) ts += pools[j] >= 0 ? target[j] : 0.f;
  ts = BlockSum(ts, sm.red);
  const float scale = *g_in * rsqrtf(static_cast<float>(a.DI));
  for (int64_t j = threadIdx.x; j < a.kp; j += kThreads) {
    const bool valid = pools[j] >= 0 && lse > -INFINITY;
    sm.logits[j] = valid ? (expf(sm.logits[j] - lse) * ts - target[j]) * scale : 0.f;
  }
  __syncthreads();
  float dq_acc[DI / 16][4], dw_acc[2] = {0.f, 0.f};
#pragma unroll
  for (int mt = 0; mt < DI / 16; ++mt) dq_acc[mt][0] = dq_acc[mt][1] = dq_acc[mt][2] = dq_acc[mt][3] = 0.f;
  const float w0 = sm.w[warp * 8 + 2 * c], w1 = sm.w[warp * 8 + 2 * c + 1];
  for (int64_t c0 = 0; c0 < a.kp; c0 += kChunk) {
    GatherChunk<DI>(sm, a, pools, c0, kb);
    __syncthreads();
    float s[4];
    ChunkDots<DI>(sm, warp, lane, s);
    const float d0 = c0 + g < a.kp ? sm.logits[c0 + g] : 0.f;          // pool g's dlog
    const float d1 = c0 + g + 8 < a.kp ? sm.logits[c0 + g + 8] : 0.f;  // pool g + 8's
    dw_acc[0] += fmaxf(s[0], 0.f) * d0 + fmaxf(s[2], 0.f) * d1;
    dw_acc[1] += fmaxf(s[1], 0.f) * d0 + fmaxf(s[3], 0.f) * d1;
    const float dd[4] = {s[0] > 0.f ? d0 * w0 : 0.f, s[1] > 0.f ? d0 * w1 : 0.f, s[2] > 0.f ? d1 * w0 : 0.f,
                         s[3] > 0.f ? d1 * w1 : 0.f};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int at = (g + 8 * (e / 2)) * kHStride + warp * 8 + 2 * c + e % 2;  // [pool][head]
      const bf16 hi = __float2bfloat16(dd[e]);
      sm.dd_hi[at] = hi;
      sm.dd_lo[at] = __float2bfloat16(dd[e] - __bfloat162float(hi));
    }
    __syncthreads();  // every warp's ddots are in
    // dq^T (DI x the warp's 8 heads) += K_c^T (DI x 16 pools) ddots (16 pools x 8 heads).
    {
      uint32_t bh[4], bl[4];
      LoadBRows(bh, sm.dd_hi, kHStride, 0, warp * 8, lane);  // (bh[0], bh[1]): heads 8w ..
      LoadBRows(bl, sm.dd_lo, kHStride, 0, warp * 8, lane);
#pragma unroll
      for (int mt = 0; mt < DI / 16; ++mt) {
        uint32_t af[4];
        LoadAT(af, sm.keys, QS, mt * 16, lane);
        Mma(dq_acc[mt], af, bh[0], bh[1]);
        Mma(dq_acc[mt], af, bl[0], bl[1]);
      }
    }
    // dk_c (16 pools x the warp's DI / 4 columns) = ddots (16 x 32 heads) Q (32 heads x DI).
    {
      constexpr int kCols = DI / kWarps;  // 32 or 16
      float dk[kCols / 8][4];
#pragma unroll
      for (int nt = 0; nt < kCols / 8; ++nt) dk[nt][0] = dk[nt][1] = dk[nt][2] = dk[nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kHeads / 16; ++kk) {
        uint32_t ah[4], al[4];
        LoadA(ah, sm.dd_hi, kHStride, kk * 16, lane);
        LoadA(al, sm.dd_lo, kHStride, kk * 16, lane);
#pragma unroll
        for (int nt = 0; nt < kCols / 8; nt += 2) {
          uint32_t bq[4];
          LoadBRows(bq, sm.q, QS, kk * 16, warp * kCols + nt * 8, lane);
          Mma(dk[nt], ah, bq[0], bq[1]);
          Mma(dk[nt], al, bq[0], bq[1]);
          Mma(dk[nt + 1], ah, bq[2], bq[3]);
          Mma(dk[nt + 1], al, bq[2], bq[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t j = c0 + g + 8 * half;
        const int pool = j < a.kp ? pools[j] : -1;
        if (pool < 0) continue;
        float* row = dk_acc + (b * a.P + pool) * a.DI + warp * kCols + 2 * c;
#pragma unroll
        for (int nt = 0; nt < kCols / 8; ++nt) {
          atomicAdd(reinterpret_cast<float2*>(row + nt * 8), make_float2(dk[nt][2 * half], dk[nt][2 * half + 1]));
        }
      }
    }
    __syncthreads();  // keys and ddots are read before the next chunk writes them
  }
  // dq: element (dim mt 16 + g + 8 (e / 2), head 8w + 2c + e % 2), one thread each.
  bf16* dqp = dq + (b * a.HI * a.S + t) * a.DI;
#pragma unroll
  for (int mt = 0; mt < DI / 16; ++mt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = warp * 8 + 2 * c + e % 2, d = mt * 16 + g + 8 * (e / 2);
      if (h < a.HI) dqp[h * a.S * a.DI + d] = __float2bfloat16(dq_acc[mt][e]);
    }
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) dw_acc[e] += __shfl_xor_sync(kFull, dw_acc[e], o);
  }
  const int h0 = warp * 8 + 2 * c;
  if (g == 0) {
    bf16* dwp = dw + (b * a.S + t) * a.HI;
    if (h0 < a.HI) dwp[h0] = __float2bfloat16(dw_acc[0]);
    if (h0 + 1 < a.HI) dwp[h0 + 1] = __float2bfloat16(dw_acc[1]);
  }
}

// Launches the kernel for a.DI (k64 or k128) over one block per row, with the shared memory of
// a.kp logits.
template <typename K, typename... Args>
cudaError_t LaunchRows(const IndexerKlArgs& a, void* stream, K k64, K k128, Args... args) {
  const K kernel = a.DI == 64 ? k64 : k128;
  const size_t bytes = a.DI == 64 ? Smem<64>::Bytes(a.kp) : Smem<128>::Bytes(a.kp);
  if (bytes > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(bytes));
    if (e != cudaSuccess) return e;
  }
  const dim3 grid(static_cast<unsigned>(a.S), static_cast<unsigned>(a.B));
  kernel<<<grid, kThreads, bytes, static_cast<cudaStream_t>(stream)>>>(a, args...);
  return cudaGetLastError();
}

}  // namespace

bool IndexerKlSupported(int64_t HI, int64_t DI) { return HI >= 8 && HI <= kHeads && HI % 8 == 0 && (DI == 64 || DI == 128); }

int IndexerKlForward(const IndexerKlArgs& a, float* kl_rows, void* stream) {
  if (a.S == 0 || a.B == 0) return cudaSuccess;
  return LaunchRows(a, stream, ForwardKernel<64>, ForwardKernel<128>, kl_rows);
}

int IndexerKlBackward(const IndexerKlArgs& a, const float* g, void* dq, void* dw, float* dk_acc, void* stream) {
  if (a.S == 0 || a.B == 0) return cudaSuccess;
  return LaunchRows(a, stream, BackwardKernel<64>, BackwardKernel<128>, g, static_cast<bf16*>(dq),
                    static_cast<bf16*>(dw), dk_acc);
}

}  // namespace odyssey::kernels::cuda
