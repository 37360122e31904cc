// The state scans of chunked KDA (kda_scan.h) on the tensor cores: mma.sync m16n8k8 with TF32
// operands and fp32 accumulators. Same blocks as kda_scan.cu (one block of 8 warps owns 32 value
// columns of one (batch, head); the chunk's operand tiles stream through two cp.async staging
// buffers), but every product of a scan step is a warp-level matrix multiply:
//  - the state S (K x 32, fp32) lives in the accumulators of the warps for the whole sequence,
//    warp w owning rows 16 (w % (K/16)) .. + 16 and K/32 column tiles of 8; a copy of it in shared
//    memory is the B operand of the (C x K) x (K x 32) products of the next chunk. The state is
//    never rounded: only its use as an operand is (TF32 keeps 10 of fp32's 23 mantissa bits, so
//    each product carries ~2^-11 relative error, the class of fla's bf16 kernels and well inside
//    the spec's error bars; the sums are fp32);
//  - the (C x 32) products (vt, o, dvt) are split over the warps by 16-row tiles and column tiles.
// Inside a k-step of 8, lane (g, c) of the mma takes its two k values from the physical columns
// k0 + 2c and k0 + 2c + 1 (the A fragment and the B fragment use the same permutation, so the sum
// is the same), which makes a row-read A fragment two 8-byte loads. Shared row strides are chosen
// so that every fragment load is free of bank conflicts: tiles read by rows (A = tile) have a
// stride of 8 (mod 32) floats, tiles read transposed (A = tile^T) and the (rows x 32) slices
// (B operands) of 4 (mod 32).
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/kda_intra.h"
#include "kernels/cuda/kda_scan.h"
#include "kernels/cuda/kda_scan_common.cuh"
#include "kernels/cuda/mma.cuh"

namespace odyssey::kernels::cuda {
namespace {

using kda_scan::kBV;
using kda_scan::kThreads;
using kda_scan::Launch;
using kda_scan::PipelineStep;
using kda_scan::Stage;
using mma::MmaTf32;
using mma::Tf32;
constexpr int kWarps = kThreads / 32;
constexpr int kSLd = kBV + 4;  // row stride of the (rows x 32) slices in shared memory

template <int C, int K>
struct Layout {
  static constexpr int kWide = K > C ? K : C;
  static constexpr int kLdRow = kWide + 8;  // tiles read by rows
  static constexpr int kLdCol = kWide + 4;  // tiles read transposed
  static constexpr int kTile = C * kLdRow;  // floats per staged tile (the larger stride)
  // The (C x 32) products: 16-row tiles x groups of column tiles over the 8 warps.
  static constexpr int kCRowTiles = C / 16;
  static constexpr int kCN = 4 * kCRowTiles / kWarps;  // column tiles of 8 per warp
  // The state (K x 32): the same over its K rows.
  static constexpr int kKRowTiles = K / 16;
  static constexpr int kKN = 4 * kKRowTiles / kWarps;
  // (Each scan's shared memory: ForwardLayout, BackwardLayout.)
  static_assert(kCN >= 1 && kKN >= 1, "C and K must be at least 32");
};

// Fragments of one k-step [k0, k0 + 8), lane = 4 g + c (PTX m16n8k8 .tf32: a0 (g, c), a1 (g + 8, c),
// a2 (g, c + 4), a3 (g + 8, c + 4); b0 (c, g), b1 (c + 4, g); logical k c -> physical k0 + 2c,
// c + 4 -> k0 + 2c + 1).
// A = rows [m0, m0 + 16) of a row-major tile (stride ld = 8 mod 32).
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const float* t, int ld, int m0, int k0, int g, int c) {
  const float2 x = *reinterpret_cast<const float2*>(t + (m0 + g) * ld + k0 + 2 * c);
  const float2 y = *reinterpret_cast<const float2*>(t + (m0 + g + 8) * ld + k0 + 2 * c);
  a[0] = Tf32(x.x), a[2] = Tf32(x.y), a[1] = Tf32(y.x), a[3] = Tf32(y.y);
}
// A = tile^T, rows [m0, m0 + 16): A[m][k] = t[k][m] (stride ld = 4 mod 32).
__device__ __forceinline__ void LoadAT(uint32_t (&a)[4], const float* t, int ld, int m0, int k0, int g, int c) {
  const float* r0 = t + (k0 + 2 * c) * ld + m0 + g;
  a[0] = Tf32(r0[0]), a[1] = Tf32(r0[8]), a[2] = Tf32(r0[ld]), a[3] = Tf32(r0[ld + 8]);
}
// B = a (rows x 32) slice (stride ld), columns [n0, n0 + 8); `negate` flips its sign. `rounded`:
// the slice holds TF32 values already (FragStore<Out::kTf32> wrote it), taken as they are: the same bits
// as rounding here (cvt.rna rounds -x to -Tf32(x)), one conversion an element instead of one a
// use.
template <bool negate = false, int ld = kSLd, bool rounded = false>
__device__ __forceinline__ void LoadB(uint32_t& b0, uint32_t& b1, const float* s, int k0, int n0, int g, int c) {
  const float* p = s + (k0 + 2 * c) * ld + n0 + g;
  if constexpr (rounded) {
    b0 = __float_as_uint(negate ? -p[0] : p[0]);
    b1 = __float_as_uint(negate ? -p[ld] : p[ld]);
  } else {
    b0 = Tf32(negate ? -p[0] : p[0]);
    b1 = Tf32(negate ? -p[ld] : p[ld]);
  }
}

// The accumulator element e of a lane: row g + 8 (e / 2), column 2c + e % 2 of its 16 x 8 tile.
// Fragments of `n` column tiles from rows [m0, m0 + 16) x columns [n0, n0 + 8 n) of a row-major
// matrix (stride ld floats) to registers, in pairs (8-byte accesses); src null = zeros.
template <int n>
__device__ __forceinline__ void FragLoad(float (&f)[n][4], const float* src, int64_t ld, int m0, int n0, int g, int c) {
#pragma unroll
  for (int j = 0; j < n; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float2 x = make_float2(0.f, 0.f);
      if (src != nullptr) x = *reinterpret_cast<const float2*>(src + (m0 + g + 8 * h) * ld + n0 + 8 * j + 2 * c);
      f[j][2 * h] = x.x, f[j][2 * h + 1] = x.y;
    }
}
// How FragStore writes an element pair: as it is (fp32), rounded to TF32 (a B operand slice that
// LoadB<.., true> reads as it is), or as bf16 (its bits, rounded to nearest even; one 4-byte store).
enum class Out { kFp32, kTf32, kBf16 };
template <Out out>
__device__ __forceinline__ void StorePair(void* p, float x, float y) {
  if constexpr (out == Out::kBf16) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
  } else if constexpr (out == Out::kTf32) {
    *reinterpret_cast<float2*>(p) = make_float2(__uint_as_float(Tf32(x)), __uint_as_float(Tf32(y)));
  } else {
    *reinterpret_cast<float2*>(p) = make_float2(x, y);
  }
}
// The fragments to a row-major matrix (stride ld elements of T: float, or uint16_t for kBf16).
template <Out out = Out::kFp32, int n, typename T>
__device__ __forceinline__ void FragStore(T* dst, int64_t ld, const float (&f)[n][4], int m0, int n0, int g, int c) {
  static_assert((out == Out::kBf16) == (sizeof(T) == 2), "bf16 pairs go to 16-bit storage, the others to fp32");
#pragma unroll
  for (int j = 0; j < n; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      StorePair<out>(dst + (m0 + g + 8 * h) * ld + n0 + 8 * j + 2 * c, f[j][2 * h], f[j][2 * h + 1]);
}
// The state (or its gradient) before chunk c to a.states or a.dS: fp32, or bf16 with kB16 (the
// bf16-operand scans keep them so for KdaChunkGrads).
template <bool kB16, int n>
__device__ __forceinline__ void StoreState(float* base, int64_t at, int64_t V, const float (&f)[n][4], int m0, int n0,
                                           int g, int c) {
  if constexpr (kB16) {
    FragStore<Out::kBf16>(reinterpret_cast<uint16_t*>(base) + at, V, f, m0, n0, g, c);
  } else {
    FragStore(base + at, V, f, m0, n0, g, c);
  }
}
// The output fragments of the chunk starting at token t0 to the caller's rows
// (KdaScanForwardArgs::o_rows), fp32 or bf16, the rows at or past o_len skipped.
template <int n>
__device__ __forceinline__ void StoreRows(const KdaScanForwardArgs& a, int64_t bh, int64_t t0, int64_t v0,
                                          const float (&f)[n][4], int m0, int n0, int g, int c) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t t = t0 + m0 + g + 8 * h;
    if (t >= a.o_len) continue;
    const int64_t row = bh * a.o_bh_stride + t * a.V + v0 + n0 + 2 * c;
#pragma unroll
    for (int j = 0; j < n; ++j) {
      if (a.o_rows_bf16) {
        StorePair<Out::kBf16>(static_cast<uint16_t*>(a.o_rows) + row + 8 * j, f[j][2 * h], f[j][2 * h + 1]);
      } else {
        StorePair<Out::kFp32>(static_cast<float*>(a.o_rows) + row + 8 * j, f[j][2 * h], f[j][2 * h + 1]);
      }
    }
  }
}
template <int n>
__device__ __forceinline__ void Zero(float (&f)[n][4]) {
#pragma unroll
  for (int j = 0; j < n; ++j) f[j][0] = f[j][1] = f[j][2] = f[j][3] = 0.f;
}

// The bf16 forms of LoadA and LoadAT over a tile staged as bf16 (w: its 32-bit words, ldw words a
// row): the same fragments and the same permutation of k.
__device__ __forceinline__ void LoadA16(uint32_t (&a)[4], const uint32_t* w, int ldw, int m0, int k0, int g, int c) {
  const uint32_t x = w[(m0 + g) * ldw + k0 / 2 + c], y = w[(m0 + g + 8) * ldw + k0 / 2 + c];
  a[0] = x << 16, a[2] = x & 0xffff0000u, a[1] = y << 16, a[3] = y & 0xffff0000u;
}
__device__ __forceinline__ void LoadAT16(uint32_t (&a)[4], const uint16_t* t, int ld, int m0, int k0, int g, int c) {
  const uint16_t* r0 = t + (k0 + 2 * c) * ld + m0 + g;
  a[0] = static_cast<uint32_t>(r0[0]) << 16, a[1] = static_cast<uint32_t>(r0[8]) << 16;
  a[2] = static_cast<uint32_t>(r0[ld]) << 16, a[3] = static_cast<uint32_t>(r0[ld + 8]) << 16;
}

// acc (rows [m0, m0 + 16), n column tiles from n0) += tile (row-major, `depth` columns) x slice
// (depth x 32). `a16`: the tile is staged as bf16, ld in 32-bit words (LoadA16); `rounded` as
// LoadB's.
template <int n, int depth, bool rounded = false, bool a16 = false>
__device__ __forceinline__ void RowsTimesSlice(float (&acc)[n][4], const float* t, int ld, const float* s, int m0,
                                               int n0, int g, int c) {
#pragma unroll
  for (int k0 = 0; k0 < depth; k0 += 8) {
    uint32_t a[4];
    if constexpr (a16) {
      LoadA16(a, reinterpret_cast<const uint32_t*>(t), ld, m0, k0, g, c);
    } else {
      LoadA(a, t, ld, m0, k0, g, c);
    }
#pragma unroll
    for (int j = 0; j < n; ++j) {
      uint32_t b0, b1;
      LoadB<false, kSLd, rounded>(b0, b1, s, k0, n0 + 8 * j, g, c);
      MmaTf32(acc[j], a, b0, b1);
    }
  }
}
// acc += tile^T (tile row-major with `depth` rows) x slice (depth x 32), or minus it. `a16` as
// RowsTimesSlice's (ld in words: a row is 2 ld bf16 values).
template <int n, int depth, bool negate = false, bool rounded = false, bool a16 = false>
__device__ __forceinline__ void TransposedTimesSlice(float (&acc)[n][4], const float* t, int ld, const float* s, int m0,
                                                     int n0, int g, int c) {
#pragma unroll
  for (int k0 = 0; k0 < depth; k0 += 8) {
    uint32_t a[4];
    if constexpr (a16) {
      LoadAT16(a, reinterpret_cast<const uint16_t*>(t), 2 * ld, m0, k0, g, c);
    } else {
      LoadAT(a, t, ld, m0, k0, g, c);
    }
#pragma unroll
    for (int j = 0; j < n; ++j) {
      uint32_t b0, b1;
      LoadB<negate, kSLd, rounded>(b0, b1, s, k0, n0 + 8 * j, g, c);
      MmaTf32(acc[j], a, b0, b1);
    }
  }
}

// The forward's blocks own BV value columns (32, or 16 for the bf16 form where 32 would leave
// multiprocessors idle) and its shared memory holds two staging buffers, one a phase: buffer 0
// phase 0's W and qg, buffer 1 phase 1's kg and Aqk. kB16: W, qg and kg are bf16 (the intra
// kernel rounded them, KdaScanForwardArgs::bf16_operands), staged as bf16 at a row stride of K + 8
// elements (K / 2 + 4 words, 4 mod 32): the row-read fragments (W, qg) and the transposed ones
// (kg) load free of bank conflicts, and a bf16 value is its TF32 operand as it is (the top 16 bits
// of an fp32), so nothing converts. Aqk stays fp32 at a stride of C + 8. A chunk then reads
// 6 C K + 4 C C bytes from L2 instead of 12 C K + 4 C C, and the block's shared memory (96 KiB
// at C = 64, K = 128) leaves room for two blocks a multiprocessor.
template <int C, int K, int BV, bool kB16>
struct ForwardLayout {
  static constexpr int kSLd = BV + 4;  // the state's and vt's copies: 4 mod 32 (B fragments)
  static constexpr int kCRowTiles = C / 16;
  static constexpr int kCN = (BV / 8) * kCRowTiles / kWarps;  // column tiles of 8 per warp
  static constexpr int kKRowTiles = K / 16;
  static constexpr int kKN = (BV / 8) * kKRowTiles / kWarps;
  static constexpr int kLdH = K / 2 + 4;  // words a row of a staged bf16 tile
  static constexpr int kLdAqk = kB16 ? C + 8 : Layout<C, K>::kLdRow;
  static constexpr int kTileH = C * kLdH;
  static constexpr int kBuf1 = kB16 ? 2 * kTileH : 2 * Layout<C, K>::kTile;  // floats before buffer 1
  static constexpr int kSecond = kB16 ? kTileH : Layout<C, K>::kTile;        // a buffer's second tile
  static constexpr int kFloats = kBuf1 + kSecond + (kB16 ? C * kLdAqk : Layout<C, K>::kTile) + K * kSLd + C * kSLd;
  static constexpr int kBlocksPerSm = kB16 ? 2 : 1;
  static_assert(kCN >= 1 && kKN >= 1 && kCN * kWarps == (BV / 8) * kCRowTiles && kKN * kWarps == (BV / 8) * kKRowTiles,
                "the warps must split the (C x BV) and (K x BV) products evenly");
};

// Two phases a chunk, each staging its tiles together (so the products of a phase that do not
// depend on each other run as independent mma chains, and a chunk waits at 4 barriers, not 8):
//   0: W and qg: vt = U - W S and o = qg S (one B fragment of S feeds both);
//   1: kg and Aqk: S <- eGC (.) S + kg^T vt and o += Aqk vt.
// The chain from one chunk's state to the next runs through W S and kg^T vt only.
template <int C, int K, int BV, bool kOut, bool kB16>
__global__ void __launch_bounds__(kThreads, (ForwardLayout<C, K, BV, kB16>::kBlocksPerSm))
    ScanForwardTf32Kernel(KdaScanForwardArgs a) {
  using L = ForwardLayout<C, K, BV, kB16>;
  using R = Layout<C, K>;
  constexpr int kLd = L::kSLd;
  extern __shared__ float4 shared4[];
  float* const sh = reinterpret_cast<float*>(shared4);
  float* const Ss = sh + L::kBuf1 + L::kSecond + (kB16 ? C * L::kLdAqk : R::kTile);  // (K x BV) the state
  float* const vts = Ss + K * kLd;                                                      // (C x BV)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c4 = lane % 4;
  const int cm0 = (warp % L::kCRowTiles) * 16, cn0 = (warp / L::kCRowTiles) * L::kCN * 8;
  const int km0 = (warp % L::kKRowTiles) * 16, kn0 = (warp / L::kKRowTiles) * L::kKN * 8;
  const int64_t bh = blockIdx.y, N = a.N, V = a.V, v0 = static_cast<int64_t>(blockIdx.x) * BV;
  // Element e of W, kg or qg (fp32 or bf16) as the float pointer Stage takes.
  constexpr int64_t kEl = kB16 ? 2 : 4;
  auto at = [&](const float* base, int64_t e) {
    return reinterpret_cast<const float*>(reinterpret_cast<const char*>(base) + e * kEl);
  };
  const int64_t ck = bh * N * C * K;
  const float* Aqk = kOut ? a.Aqk + bh * N * C * C : nullptr;
  const float* U = a.U + bh * N * C * V + v0;
  const float* eGC = a.eGC + bh * N * K;
  constexpr int kPhases = 2;
  auto issue = [&](int64_t j) {
    const int64_t c = j / kPhases;
    if (j % kPhases == 0) {
      float* dst = sh;
      if constexpr (kB16) {
        Stage(dst, L::kLdH, at(a.W, ck + c * C * K), C, K / 2, K / 2);
        if (kOut) Stage(dst + L::kTileH, L::kLdH, at(a.qg, ck + c * C * K), C, K / 2, K / 2);
      } else {
        Stage(dst, R::kLdRow, at(a.W, ck + c * C * K), C, K, K);
        if (kOut) Stage(dst + R::kTile, R::kLdRow, at(a.qg, ck + c * C * K), C, K, K);
      }
    } else {
      float* dst = sh + L::kBuf1;
      if constexpr (kB16) {
        Stage(dst, L::kLdH, at(a.kg, ck + c * C * K), C, K / 2, K / 2);
      } else {
        Stage(dst, R::kLdCol, at(a.kg, ck + c * C * K), C, K, K);
      }
      if (kOut) Stage(dst + L::kSecond, L::kLdAqk, Aqk + c * C * C, C, C, C);
    }
    __pipeline_commit();
  };
  float S[L::kKN][4], u[L::kCN][4], un[L::kCN][4], out[L::kCN][4];
  FragLoad(S, a.h0 != nullptr ? a.h0 + bh * K * V + v0 : nullptr, V, km0, kn0, g, c4);
  FragStore<Out::kTf32>(Ss, kLd, S, km0, kn0, g, c4);
  FragLoad(u, U, V, cm0, cn0, g, c4);
  issue(0);
  const int64_t total = N * kPhases;
  for (int64_t c = 0; c < N; ++c) {
#pragma unroll
    for (int p = 0; p < kPhases; ++p) {
      const int64_t j = c * kPhases + p;
      PipelineStep(j, total, issue);
      const float* t = sh + (p == 0 ? 0 : L::kBuf1);
      const float* t2 = t + L::kSecond;
      if (p == 0) {
        if (a.states != nullptr) StoreState<kB16>(a.states, (bh * N + c) * K * V + v0, V, S, km0, kn0, g, c4);
        if (c + 1 < N) FragLoad(un, U + (c + 1) * C * V, V, cm0, cn0, g, c4);
        float acc[L::kCN][4];
        Zero(acc);
        if (kOut) Zero(out);
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += 8) {
          uint32_t aw[4], aq[4];
          if constexpr (kB16) {
            LoadA16(aw, reinterpret_cast<const uint32_t*>(t), L::kLdH, cm0, k0, g, c4);
            if (kOut) LoadA16(aq, reinterpret_cast<const uint32_t*>(t2), L::kLdH, cm0, k0, g, c4);
          } else {
            LoadA(aw, t, R::kLdRow, cm0, k0, g, c4);
            if (kOut) LoadA(aq, t2, R::kLdRow, cm0, k0, g, c4);
          }
#pragma unroll
          for (int i = 0; i < L::kCN; ++i) {
            uint32_t b0, b1;
            LoadB<false, kLd, true>(b0, b1, Ss, k0, cn0 + 8 * i, g, c4);
            MmaTf32(acc[i], aw, b0, b1);
            if (kOut) MmaTf32(out[i], aq, b0, b1);
          }
        }
#pragma unroll
        for (int i = 0; i < L::kCN; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][e] = u[i][e] - acc[i][e];
        FragStore<Out::kTf32>(vts, kLd, acc, cm0, cn0, g, c4);
        if (a.vt != nullptr) FragStore(a.vt + (bh * N + c) * C * V + v0, V, acc, cm0, cn0, g, c4);
      } else {
        const float eg0 = eGC[c * K + km0 + g], eg1 = eGC[c * K + km0 + g + 8];
#pragma unroll
        for (int i = 0; i < L::kKN; ++i) S[i][0] *= eg0, S[i][1] *= eg0, S[i][2] *= eg1, S[i][3] *= eg1;
#pragma unroll
        for (int k0 = 0; k0 < C; k0 += 8) {
          uint32_t ak[4];
          if constexpr (kB16) {
            LoadAT16(ak, reinterpret_cast<const uint16_t*>(t), 2 * L::kLdH, km0, k0, g, c4);
          } else {
            LoadAT(ak, t, R::kLdCol, km0, k0, g, c4);
          }
#pragma unroll
          for (int i = 0; i < L::kKN; ++i) {
            uint32_t b0, b1;
            LoadB<false, kLd, true>(b0, b1, vts, k0, kn0 + 8 * i, g, c4);
            MmaTf32(S[i], ak, b0, b1);
          }
          if (kOut) {
            uint32_t aa[4];
            LoadA(aa, t2, L::kLdAqk, cm0, k0, g, c4);
#pragma unroll
            for (int i = 0; i < L::kCN; ++i) {
              uint32_t b0, b1;
              LoadB<false, kLd, true>(b0, b1, vts, k0, cn0 + 8 * i, g, c4);
              MmaTf32(out[i], aa, b0, b1);
            }
          }
        }
        FragStore<Out::kTf32>(Ss, kLd, S, km0, kn0, g, c4);
        if (kOut) {
          if (a.o_rows == nullptr) {
            FragStore(a.o + (bh * N + c) * C * V + v0, V, out, cm0, cn0, g, c4);
          } else {
            StoreRows(a, bh, c * C, v0, out, cm0, cn0, g, c4);
          }
        }
#pragma unroll
        for (int i = 0; i < L::kCN; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) u[i][e] = un[i][e];
      }
      __syncthreads();
    }
  }
  FragStore(a.hN + bh * K * V + v0, V, S, km0, kn0, g, c4);
}

// The reverse scan's two staging buffers: buffer 0 phase 1's W (read transposed) and the next
// chunk's Aqk (read transposed; the prologue's for the last chunk), buffer 1 phase 0's kg (read
// by rows) and qg (transposed). kB16: W, kg and qg bf16 as the forward's (ForwardLayout), Aqk fp32
// at a stride of C + 4 (4 mod 32: transposed fragments).
template <int C, int K, bool kB16>
struct BackwardLayout {
  using R = Layout<C, K>;
  static constexpr int kLdH = K / 2 + 4;
  static constexpr int kTileH = C * kLdH;
  static constexpr int kAqk = kB16 ? kTileH : R::kTile;         // Aqk's offset in buffer 0
  static constexpr int kLdAqk = kB16 ? C + 4 : R::kLdCol;
  static constexpr int kBuf1 = kB16 ? kTileH + C * kLdAqk : 2 * R::kTile;  // floats before buffer 1
  static constexpr int kSecond = kB16 ? kTileH : R::kTile;      // qg's offset in buffer 1
  static constexpr int kEnd = kBuf1 + (kB16 ? 2 * kTileH : 2 * R::kTile);
  // Both buffers, the state gradient's copy (K x 32), dvt's (C x 32) and dO's two slices.
  static constexpr int kFloats = kEnd + K * kSLd + 3 * C * kSLd;
};

// Two phases a chunk, c from N - 1 down, the state gradient dS in the accumulators:
//   0: kg and qg: dvt = P + kg dS (from dS's shared copy) and, independently,
//      dS <- eGC (.) dS + qg^T dO;
//   1: W, and the next chunk's Aqk and dO: dS -= W^T dvt, copied to shared memory for the next
//      chunk, and, independently, the next chunk's P = Aqk^T dO (so P is never written out).
// dO's slice is double-buffered by chunk: staged in phase 1 of the chunk after it (a prologue
// for the last chunk), read there for P and in its own phase 0. kB16: W, kg and qg are bf16
// (KdaScanBackwardArgs::bf16_operands).
template <int C, int K, bool kB16>
__global__ void __launch_bounds__(kThreads) ScanBackwardTf32Kernel(KdaScanBackwardArgs a) {
  using L = Layout<C, K>;
  using BL = BackwardLayout<C, K, kB16>;
  extern __shared__ float4 shared4[];
  float* const sh = reinterpret_cast<float*>(shared4);
  float* const buf1 = sh + BL::kBuf1;
  float* const dSs = sh + BL::kEnd;    // (K x 32) the gradient of the state after chunk c
  float* const dvts = dSs + K * kSLd;  // (C x 32)
  float* const dOs = dvts + C * kSLd;  // 2 x (C x 32): chunk c's slice at dOs + (c & 1) C kSLd
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c4 = lane % 4;
  const int cm0 = (warp % L::kCRowTiles) * 16, cn0 = (warp / L::kCRowTiles) * L::kCN * 8;
  const int km0 = (warp % L::kKRowTiles) * 16, kn0 = (warp / L::kKRowTiles) * L::kKN * 8;
  const int64_t bh = blockIdx.y, N = a.N, V = a.V, v0 = static_cast<int64_t>(blockIdx.x) * kBV;
  // Chunk c's tile of W, kg or qg (fp32 or bf16) as the float pointer Stage takes.
  auto tile = [&](const float* base, int64_t c) {
    return reinterpret_cast<const float*>(reinterpret_cast<const char*>(base) +
                                          (bh * N + c) * C * K * (kB16 ? 2 : 4));
  };
  // Stages one (C x K) tile of W, kg or qg at dst: rows at `ld` floats (fp32) or as bf16.
  auto stage_wqk = [&](float* dst, int ld, const float* base, int64_t c) {
    if constexpr (kB16) {
      Stage(dst, BL::kLdH, tile(base, c), C, K / 2, K / 2);
    } else {
      Stage(dst, ld, tile(base, c), C, K, K);
    }
  };
  const float* Aqk = a.Aqk + bh * N * C * C;
  const float* dO = a.dO + bh * N * C * V + v0;
  const float* eGC = a.eGC + bh * N * K;
  auto dOslice = [&](int64_t c) { return dOs + (c & 1) * C * kSLd; };
  // Chunk c's Aqk (read transposed) into buffer 0 and its dO slice into its buffer.
  auto stage_p = [&](int64_t c) {
    Stage(sh + BL::kAqk, BL::kLdAqk, Aqk + c * C * C, C, C, C);
    Stage(dOslice(c), kSLd, dO + c * C * V, C, kBV, V);
  };
  // Group 0: the last chunk's Aqk and dO; then groups 1 + 2 step + p, p the phase of chunk
  // N - 1 - step (phase 0 in buffer 1, phase 1 in buffer 0).
  auto issue = [&](int64_t j) {
    if (j == 0) {
      stage_p(N - 1);
    } else {
      const int64_t c = N - 1 - (j - 1) / 2;
      if ((j - 1) % 2 == 0) {
        stage_wqk(buf1, L::kLdRow, a.kg, c);
        stage_wqk(buf1 + BL::kSecond, L::kLdCol, a.qg, c);
      } else {
        stage_wqk(sh, L::kLdCol, a.W, c);
        if (c > 0) stage_p(c - 1);
      }
    }
    __pipeline_commit();
  };
  // The A tiles' strides: fp32 floats, or the bf16 rows' words.
  constexpr int kRowLd = kB16 ? BL::kLdH : L::kLdRow, kColLd = kB16 ? BL::kLdH : L::kLdCol;
  float dS[L::kKN][4], pr[L::kCN][4], pn[L::kCN][4];
  FragLoad(dS, a.dSN != nullptr ? a.dSN + bh * K * V + v0 : nullptr, V, km0, kn0, g, c4);
  FragStore<Out::kTf32>(dSs, kSLd, dS, km0, kn0, g, c4);
  const int64_t total = 1 + 2 * N;
  issue(0);
  issue(1);
  __pipeline_wait_prior(1);
  __syncthreads();
  Zero(pr);
  TransposedTimesSlice<L::kCN, C>(pr, sh + BL::kAqk, BL::kLdAqk, dOslice(N - 1), cm0, cn0, g, c4);
  __syncthreads();
  for (int64_t step = 0; step < N; ++step) {
    const int64_t c = N - 1 - step;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int64_t j = 1 + step * 2 + p;
      PipelineStep(j, total, issue);
      if (p == 0) {
        StoreState<kB16>(a.dS, (bh * N + c) * K * V + v0, V, dS, km0, kn0, g, c4);
        const float eg0 = eGC[c * K + km0 + g], eg1 = eGC[c * K + km0 + g + 8];
#pragma unroll
        for (int i = 0; i < L::kKN; ++i) dS[i][0] *= eg0, dS[i][1] *= eg0, dS[i][2] *= eg1, dS[i][3] *= eg1;
        RowsTimesSlice<L::kCN, K, true, kB16>(pr, buf1, kRowLd, dSs, cm0, cn0, g, c4);
        TransposedTimesSlice<L::kKN, C, false, false, kB16>(dS, buf1 + BL::kSecond, kColLd, dOslice(c), km0, kn0, g,
                                                             c4);
        FragStore<Out::kTf32>(dvts, kSLd, pr, cm0, cn0, g, c4);
        FragStore(a.dvt + (bh * N + c) * C * V + v0, V, pr, cm0, cn0, g, c4);
      } else {
        TransposedTimesSlice<L::kKN, C, true, true, kB16>(dS, sh, kColLd, dvts, km0, kn0, g, c4);
        Zero(pn);
        if (c > 0) {
          TransposedTimesSlice<L::kCN, C>(pn, sh + BL::kAqk, BL::kLdAqk, dOslice(c - 1), cm0, cn0, g, c4);
        }
        FragStore<Out::kTf32>(dSs, kSLd, dS, km0, kn0, g, c4);
#pragma unroll
        for (int i = 0; i < L::kCN; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) pr[i][e] = pn[i][e];
      }
      __syncthreads();
    }
  }
  FragStore(a.dS0 + bh * K * V + v0, V, dS, km0, kn0, g, c4);
}

// The chunk gradients given the states (kda_scan.h KdaChunkGrads): 16 warps, warp w owning the
// 16-row tile (w % (C/16)) of every output and every (16 / (C/16))-th column tile of 8 from
// w / (C/16). An item's operands stream through two staging buffers in slices of 32 value
// columns (the reduction index of every product), each slice read by rows: dO, dvt and vt as A
// fragments, h, dS and vt as B = X^T fragments (X[n][k]), all with stride 40 (8 mod 32).
namespace chunk_grads {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kLd = kBV + 8;

constexpr int kLdH = kBV / 2 + 4;  // words a row of a bf16 (K x 32) slice (4 mod 32)

// kB16: h and dS are bf16 (KdaChunkGradsArgs::bf16), staged as bf16 at kLdH words a row.
template <int C, int K, bool kB16 = false>
struct Layout {
  static constexpr int kLdS = kB16 ? kLdH : kLd;  // h's and dS's rows (floats or words)
  static constexpr int kStage = 2 * K * kLdS + 3 * C * kLd;  // h, dS (K x 32); dO, vt, dvt (C x 32)
  static constexpr int kFloats = 2 * kStage;
  static constexpr int kRowTiles = C / 16;
  static constexpr int kWarpsPerRow = kWarps / kRowTiles;
  static constexpr int kKT = (K / 8 + kWarpsPerRow - 1) / kWarpsPerRow;  // column tiles of K a warp
  static constexpr int kCT = (C / 8 + kWarpsPerRow - 1) / kWarpsPerRow;  // of C (dAqk)
  static constexpr int kTpr = kThreads / K;                              // deGC: threads a row
  static_assert(kTpr >= 1 && kBV % kTpr == 0, "K must divide the block and 32 columns split over a row");
};

// B = X^T columns [n0, n0 + 8): b0 (c, g) = X[n0 + g][k0 + 2c], b1 = X[n0 + g][k0 + 2c + 1] (the
// permuted k of LoadA).
__device__ __forceinline__ void LoadBT(uint32_t& b0, uint32_t& b1, const float* x, int n0, int k0, int g, int c) {
  const float2 v = *reinterpret_cast<const float2*>(x + (n0 + g) * kLd + k0 + 2 * c);
  b0 = Tf32(v.x), b1 = Tf32(v.y);
}
// The same from a bf16 slice (kLdH words a row): the pair is one word, each half its TF32 operand.
__device__ __forceinline__ void LoadBT16(uint32_t& b0, uint32_t& b1, const float* x, int n0, int k0, int g, int c) {
  const uint32_t w = reinterpret_cast<const uint32_t*>(x)[(n0 + g) * kLdH + k0 / 2 + c];
  b0 = w << 16, b1 = w & 0xffff0000u;
}
// Element (r, e) of an h or dS slice, fp32 or bf16.
template <bool kB16>
__device__ __forceinline__ float SliceAt(const float* x, int r, int e) {
  if constexpr (kB16) {
    return __uint_as_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(x)[r * 2 * kLdH + e]) << 16);
  } else {
    return x[r * kLd + e];
  }
}

// One 16 x 8 accumulator tile to rows [m0, m0 + 16) x columns [n0, n0 + 8) of a row-major matrix,
// times `sign`.
__device__ __forceinline__ void StoreTile(float* dst, int64_t ld, const float (&f)[4], int m0, int n0, int g, int c,
                                          float sign) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
    *reinterpret_cast<float2*>(dst + (m0 + g + 8 * h) * ld + n0 + 2 * c) =
        make_float2(sign * f[2 * h], sign * f[2 * h + 1]);
}

}  // namespace chunk_grads

template <int C, int K, bool kB16>
__global__ void __launch_bounds__(chunk_grads::kThreads) ChunkGradsTf32Kernel(KdaChunkGradsArgs a) {
  using L = chunk_grads::Layout<C, K, kB16>;
  using chunk_grads::kLd;
  using chunk_grads::LoadBT;
  using chunk_grads::StoreTile;
  constexpr int kNT = chunk_grads::kThreads;
  extern __shared__ float4 shared4[];
  float* const sh = reinterpret_cast<float*>(shared4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c4 = lane % 4;
  const int m0 = (warp % L::kRowTiles) * 16, wc = warp / L::kRowTiles;
  const int64_t V = a.V, items = a.BH * a.N, slices = V / kBV;
  const int64_t mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int64_t total = mine * slices;
  auto item_of = [&](int64_t j) { return static_cast<int64_t>(blockIdx.x) + (j / slices) * gridDim.x; };
  auto issue = [&](int64_t j) {
    const int64_t it = item_of(j), v0 = (j % slices) * kBV;
    float* h = sh + (j & 1) * L::kStage;
    if constexpr (kB16) {  // (as floats: pairs of bf16)
      const float* hs = reinterpret_cast<const float*>(reinterpret_cast<const uint16_t*>(a.states) + it * K * V + v0);
      const float* ds = reinterpret_cast<const float*>(reinterpret_cast<const uint16_t*>(a.dS) + it * K * V + v0);
      Stage<kNT>(h, L::kLdS, hs, K, kBV / 2, V / 2);
      Stage<kNT>(h + K * L::kLdS, L::kLdS, ds, K, kBV / 2, V / 2);
    } else {
      Stage<kNT>(h, kLd, a.states + it * K * V + v0, K, kBV, V);
      Stage<kNT>(h + K * kLd, kLd, a.dS + it * K * V + v0, K, kBV, V);
    }
    float* const rest = h + 2 * K * L::kLdS;
    Stage<kNT>(rest, kLd, a.dO + it * C * V + v0, C, kBV, V);
    Stage<kNT>(rest + C * kLd, kLd, a.vt + it * C * V + v0, C, kBV, V);
    Stage<kNT>(rest + 2 * C * kLd, kLd, a.dvt + it * C * V + v0, C, kBV, V);
    __pipeline_commit();
  };
  float dq[L::kKT][4], dw[L::kKT][4], dk[L::kKT][4], da[L::kCT][4];
  // deGC: thread t sums row t / kTpr over its kBV / kTpr columns of each slice.
  constexpr int kCpt = kBV / L::kTpr;
  const int er = threadIdx.x / L::kTpr, ec = (threadIdx.x % L::kTpr) * kCpt;
  float eg = 0.f;
  if (total > 0) issue(0);
  for (int64_t j = 0; j < total; ++j) {
    PipelineStep(j, total, issue);
    const int64_t slice = j % slices;
    if (slice == 0) {
      Zero(dq), Zero(dw), Zero(dk), Zero(da);
      eg = 0.f;
    }
    const float* h = sh + (j & 1) * L::kStage;
    const float* dS = h + K * L::kLdS;
    const float* dO = dS + K * L::kLdS;
    const float* vt = dO + C * kLd;
    const float* dvt = vt + C * kLd;
#pragma unroll
    for (int k0 = 0; k0 < kBV; k0 += 8) {
      uint32_t ao[4], av[4], ad[4];
      LoadA(ao, dO, kLd, m0, k0, g, c4);
      LoadA(av, vt, kLd, m0, k0, g, c4);
      LoadA(ad, dvt, kLd, m0, k0, g, c4);
#pragma unroll
      for (int i = 0; i < L::kKT; ++i) {
        const int n0 = (wc + L::kWarpsPerRow * i) * 8;
        if (n0 < K) {
          uint32_t b0, b1;
          if constexpr (kB16) {
            chunk_grads::LoadBT16(b0, b1, h, n0, k0, g, c4);
          } else {
            LoadBT(b0, b1, h, n0, k0, g, c4);
          }
          MmaTf32(dq[i], ao, b0, b1);
          MmaTf32(dw[i], ad, b0, b1);
          if constexpr (kB16) {
            chunk_grads::LoadBT16(b0, b1, dS, n0, k0, g, c4);
          } else {
            LoadBT(b0, b1, dS, n0, k0, g, c4);
          }
          MmaTf32(dk[i], av, b0, b1);
        }
      }
#pragma unroll
      for (int i = 0; i < L::kCT; ++i) {
        const int n0 = (wc + L::kWarpsPerRow * i) * 8;
        if (n0 < C) {
          uint32_t b0, b1;
          LoadBT(b0, b1, vt, n0, k0, g, c4);
          MmaTf32(da[i], ao, b0, b1);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < kCpt; ++e) {
      eg = fmaf(chunk_grads::SliceAt<kB16>(h, er, ec + e), chunk_grads::SliceAt<kB16>(dS, er, ec + e), eg);
    }
    if (slice == slices - 1) {
      const int64_t it = item_of(j);
#pragma unroll
      for (int i = 0; i < L::kKT; ++i) {
        const int n0 = (wc + L::kWarpsPerRow * i) * 8;
        if (n0 < K) {
          StoreTile(a.dqg + it * C * K, K, dq[i], m0, n0, g, c4, 1.f);
          StoreTile(a.dW + it * C * K, K, dw[i], m0, n0, g, c4, -1.f);
          StoreTile(a.dkg + it * C * K, K, dk[i], m0, n0, g, c4, 1.f);
        }
      }
#pragma unroll
      for (int i = 0; i < L::kCT; ++i) {
        const int n0 = (wc + L::kWarpsPerRow * i) * 8;
        if (n0 < C) StoreTile(a.dAqk + it * C * C, C, da[i], m0, n0, g, c4, 1.f);
      }
#pragma unroll
      for (int off = L::kTpr / 2; off > 0; off /= 2) eg += __shfl_xor_sync(0xffffffffu, eg, off);
      if (threadIdx.x % L::kTpr == 0) a.deGC[it * K + er] = eg;
    }
    __syncthreads();
  }
}

// One launch of the forward kernel over the (V / BV, BH) grid.
template <int C, int K, int BV, bool kOut, bool kB16>
int LaunchForward(const KdaScanForwardArgs& a, cudaStream_t stream) {
  auto* kernel = &ScanForwardTf32Kernel<C, K, BV, kOut, kB16>;
  const int bytes = static_cast<int>(ForwardLayout<C, K, BV, kB16>::kFloats * sizeof(float));
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  // All of the multiprocessor's unified L1 as shared memory: room for two bf16-form blocks.
  if (e == cudaSuccess && kB16) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             static_cast<int>(cudaSharedmemCarveoutMaxShared));
  }
  if (e != cudaSuccess) return static_cast<int>(e);
  const dim3 grid(static_cast<unsigned>(a.V / BV), static_cast<unsigned>(a.BH));
  kernel<<<grid, kThreads, bytes, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <int C, int K>
int Forward(const KdaScanForwardArgs& a, cudaStream_t stream) {
  if (a.bf16_operands) {
    if (a.qg == nullptr) return LaunchForward<C, K, 32, false, true>(a, stream);
    // Blocks of 16 value columns where the 32-column grid would not fill the multiprocessors
    // twice over (the warps need C = 64 and K >= 64 to split a 16-column product).
    if constexpr (C == 64 && K >= 64) {
      if (a.value_block == 16) return LaunchForward<C, K, 16, true, true>(a, stream);
    }
    return LaunchForward<C, K, 32, true, true>(a, stream);
  }
  return a.qg != nullptr ? LaunchForward<C, K, 32, true, false>(a, stream)
                         : LaunchForward<C, K, 32, false, false>(a, stream);
}

template <int C, int K>
int Backward(const KdaScanBackwardArgs& a, cudaStream_t stream) {
  if (a.bf16_operands) {
    return Launch(&ScanBackwardTf32Kernel<C, K, true>, a, BackwardLayout<C, K, true>::kFloats * sizeof(float), stream);
  }
  return Launch(&ScanBackwardTf32Kernel<C, K, false>, a, BackwardLayout<C, K, false>::kFloats * sizeof(float), stream);
}

}  // namespace

// (C, K) as kda_intra.h's ByChunkAndKey instantiates them; KdaScanForward and KdaScanBackward
// checked the sizes.
int KdaScanForwardTf32(const KdaScanForwardArgs& a, void* stream) {
  return ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    return Forward<decltype(c)::value, decltype(k)::value>(a, static_cast<cudaStream_t>(stream));
  });
}

int KdaScanBackwardTf32(const KdaScanBackwardArgs& a, void* stream) {
  return ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    return Backward<decltype(c)::value, decltype(k)::value>(a, static_cast<cudaStream_t>(stream));
  });
}

int KdaChunkGrads(const KdaChunkGradsArgs& a, void* stream) {
  if (!KdaScanSupported(a.C, a.K, a.V) || a.N <= 0 || a.BH <= 0) return static_cast<int>(cudaErrorInvalidValue);
  int device = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return static_cast<int>(e);
  return ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    constexpr int C = decltype(c)::value, K = decltype(k)::value;
    auto* kernel = a.bf16 ? &ChunkGradsTf32Kernel<C, K, true> : &ChunkGradsTf32Kernel<C, K, false>;
    const size_t floats = a.bf16 ? chunk_grads::Layout<C, K, true>::kFloats : chunk_grads::Layout<C, K, false>::kFloats;
    const size_t bytes = floats * sizeof(float);
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (err != cudaSuccess) return static_cast<int>(err);
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, chunk_grads::kThreads, bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    // One wave of blocks, each walking its share of the (batch x head, chunk) items.
    const int64_t blocks = std::min<int64_t>(a.BH * a.N, static_cast<int64_t>(sms) * std::max(per_sm, 1));
    kernel<<<static_cast<unsigned>(blocks), chunk_grads::kThreads, bytes, static_cast<cudaStream_t>(stream)>>>(a);
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace odyssey::kernels::cuda
