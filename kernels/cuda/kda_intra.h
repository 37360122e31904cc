// Launcher of chunked KDA's chunk-local quantities (kernels/cuda/kda_intra.cu): spec 1.3 steps
// 1-2 for the whole-chunk Gram form (no chunk decays by more than 60 e-folds, kernels/kda.h
// KdaDecayedGramForm), which kernels/kda.cc's ComputeIntra otherwise builds from ~30 libtorch
// ops over (B, HV, N, C, K) fp32 tensors. One thread block of 512 threads per (batch x head,
// chunk), everything of the chunk in shared memory:
//   Ep = exp(G - G_0), Em = exp(G_0 - G)        (G_0: the chunk's first row of G)
//   kp = k Ep, km = k Em, qp = q Ep             (element-wise)
//   Lkk = strict_lower(kp km^T), A_kk = diag(beta) Lkk, Aqk = lower(qp km^T)
//   T = (I + A_kk)^-1                            (unit lower triangular: forward substitution)
//   X = beta k exp(G), Y = beta v, W = T X, U = T Y
//   kg = k exp(G_C - G), qg = q exp(G), eGC = exp(G_C)   (G_C: the chunk's last row)
// all in fp32, the same formulas as ComputeIntra's (sums in another order). With `cache` set the
// block also writes what the hand-written backward (IntraBackward) reads: T, Lkk, Ep, Em, qp, kp,
// km, X, Y, EC = exp(G_C - G) and eG = exp(G).
//
// Raw device pointers (no CUDA or libtorch headers here). q, k (B, HV, L, K) and v (B, HV, L, V)
// with element strides for batch, head and token (the last dim contiguous); beta (B, HV, L)
// strided the same way; rows at or past L are zeros (the padding of the last chunk). q, k and v
// are all fp32 or all bf16, beta either (`bf16`'s bits, KdaLoad), as the caller holds them: the
// block converts as it reads, and multiplies q by `q_scale`, so no fp32 copy of the inputs is
// ever made.
// G (BH, N, C, K) contiguous, 16-byte aligned: the chunk-local cumulative sums of g, padding
// included. Outputs contiguous: qg, kg, W, Ep, Em, qp, kp, km, X, EC, eG (BH, N, C, K); U, Y
// (BH, N, C, V); Aqk, T, Lkk (BH, N, C, C); eGC (BH, N, K); qg, kg and W 16-byte aligned (written
// 4 elements a store; refused otherwise). Supported: KdaIntraSupported. Returns the launch's
// cudaError_t as an int (0 = success). Only built with ODYSSEY_CUDA.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace odyssey::kernels::cuda {

// f(std::integral_constant<int, C>, std::integral_constant<int, K>) for the chunk and key sizes a
// KDA block kernel is instantiated for (C in {32, 64}, K in {32, 64, 128}; anything else takes
// (32, 32): the callers check the sizes first).
template <class F>
decltype(auto) ByChunkAndKey(int64_t C, int64_t K, F&& f) {
  using C64 = std::integral_constant<int, 64>;
  using C32 = std::integral_constant<int, 32>;
  using K128 = std::integral_constant<int, 128>;
  if (C == 64 && K == 128) return f(C64{}, K128{});
  if (C == 64 && K == 64) return f(C64{}, C64{});
  if (C == 64 && K == 32) return f(C64{}, C32{});
  if (C == 32 && K == 128) return f(C32{}, K128{});
  if (C == 32 && K == 64) return f(C32{}, C64{});
  return f(C32{}, C32{});
}

// C in {32, 64}, K in {32, 64, 128}, V a multiple of 4 up to 128 (the block's shared memory holds
// the chunk).
bool KdaIntraSupported(int64_t C, int64_t K, int64_t V);

// Which of the chunk kernels' inputs are bf16 (the others fp32): KdaIntraArgs::bf16 and
// KdaIntraBackwardArgs::bf16 are these bits.
enum : uint8_t { kKdaBf16Q = 1, kKdaBf16K = 2, kKdaBf16V = 4, kKdaBf16Beta = 8 };

#if defined(__CUDACC__)
#define KDA_LOAD_HD __host__ __device__ __forceinline__
#else
#define KDA_LOAD_HD inline
#endif
// Element i of an input that is bf16 (its 16 bits are the top half of an fp32: exact) or fp32.
KDA_LOAD_HD float KdaLoad(const void* p, bool bf16, int64_t i) {
  if (bf16) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
#if defined(__CUDA_ARCH__)
    return __uint_as_float(bits);
#else
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
#endif
  }
  return static_cast<const float*>(p)[i];
}
// The same with the dtype fixed at compile time: the kernels are built for q, k and v all fp32 or
// all bf16 (KdaQkvBf16), so the loads of their inner loops carry no branch.
template <bool kBf16>
KDA_LOAD_HD float KdaLoadAs(const void* p, int64_t i) {
  if constexpr (kBf16) {
    return KdaLoad(p, true, i);
  } else {
    return static_cast<const float*>(p)[i];
  }
}
// Element i of an output that is bf16 (rounded to nearest, ties to even, as libtorch's casts round)
// or fp32.
KDA_LOAD_HD void KdaStore(void* p, bool bf16, int64_t i, float v) {
  if (bf16) {
#if defined(__CUDA_ARCH__)
    const uint32_t u = __float_as_uint(v);
#else
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
#endif
    const uint32_t r = v != v ? 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(r);
    return;
  }
  static_cast<float*>(p)[i] = v;
}
// The same with the dtype fixed at compile time (q's, k's and v's gradients take their dtype).
template <bool kBf16>
KDA_LOAD_HD void KdaStoreAs(void* p, int64_t i, float v) {
  KdaStore(p, kBf16, i, v);
}
// q, k and v share a dtype (the kernels' requirement; beta has its own bit), and which.
KDA_LOAD_HD bool KdaQkvSameDtype(uint8_t bits) {
  const int m = bits & (kKdaBf16Q | kKdaBf16K | kKdaBf16V);
  return m == 0 || m == (kKdaBf16Q | kKdaBf16K | kKdaBf16V);
}
KDA_LOAD_HD bool KdaQkvBf16(uint8_t bits) { return (bits & kKdaBf16Q) != 0; }
// Whether p starts on a multiple of `bytes` (the launchers' checks before vector loads, stores and
// cp.async copies).
KDA_LOAD_HD bool KdaAligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
#undef KDA_LOAD_HD

struct KdaIntraCache {
  float *T, *Lkk, *Ep, *Em, *qp, *kp, *km, *X, *Y, *EC, *eG;
};

struct KdaIntraArgs {
  const void *q, *k, *v, *beta;  // fp32 or bf16 (`bf16`)
  const float* G;
  int64_t q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st, b_sb, b_sh, b_st;
  int64_t B, HV, N, C, K, V, L;
  float *qg, *kg, *W, *U, *Aqk, *eGC;
  const KdaIntraCache* cache;  // null: the forward's outputs only
  uint8_t bf16 = 0;            // kKdaBf16* bits: which of q, k, v, beta are bf16
  float q_scale = 1.f;         // q as read is q * q_scale
  // KdaIntraForward's Grams and W = T X, U = T Y on the tensor cores (TF32 operands, fp32 sums;
  // V a multiple of 8, else the CUDA-core form); the factors and the UT inverse stay fp32.
  bool tf32 = false;
  // W, qg and kg written as bf16 (rounded to nearest even; their pointers then point at bf16
  // storage): what the forward's state scan reads as its bf16 operands
  // (KdaScanForwardArgs::bf16_operands). Needs tf32, V a multiple of 8 and no cache.
  bool wqk_bf16 = false;
  // Set: T = (I + A_kk)^-1 also written here, fp32 (BH, N, C, C) row-major, for the intra-chunk
  // backward of the same segment to read (KdaIntraBackwardArgs::T) instead of inverting again.
  float* T_out = nullptr;
};
int KdaIntraForward(const KdaIntraArgs& args, void* stream);
// Whether KdaIntraForward reads q, k and v 4 elements a load (8 bytes bf16, 16 fp32): their bases
// and every batch, head and token stride aligned to that; else one element a load (same values).
bool KdaIntraVectorLoads(const KdaIntraArgs& args);

}  // namespace odyssey::kernels::cuda
