// Sparse attention on the tensor cores (kernels/cuda/sparse_attention_mma.cu): the bf16 path of
// the launchers in sparse_attention.h, which call these where SparseAttentionMmaSupported holds
// and SparseAttentionTensorCores() is on; the CUDA-core kernels run everything else (fp32,
// other head dims, more than 8 heads a KV head).
//
// Same arguments, layouts and results as sparse_attention.h's launchers. The operands q, k, v, dO
// are bf16 already; p and ds (and the query side's p dp), which the CUDA-core kernels keep in
// fp32, enter the mma as two bf16 parts (x's rounding and the remainder: ~16 bits), so the
// results stay within fp32-kernel noise rather than flash attention's 8-bit p. The probabilities
// kernel needs the forward's log-sum-exp (without it the CUDA-core kernel runs).
//   - Forward and query side: one block per (token, KV head); each warp gathers 16 selected
//     keys' k and v rows at a time (cp.async, coalesced: 16 lanes a row), S^T = K Q^T for the
//     group's heads (up to 8: the mma's N), online softmax, O^T += V^T P.
//   - Key side: one block per (aligned block of 4 keys, KV head), over (unit, head) rows 16 at a
//     time: the rows' q and dO gathered, S = Q K_blk^T, then dK^T += Q^T ds, dV^T += dO^T p.
//   - Probabilities: one block per token; a warp owns 16 entries and walks the KV heads.
// Deterministic: fixed work per warp, fixed merge order, no atomics.
#pragma once

#include <type_traits>

#include "kernels/cuda/sparse_attention.h"

namespace odyssey::kernels::cuda {

// Calls f(D-constant, Dv-constant) (std::integral_constant<int, 64 or 128>) for a.D, a.Dv: the
// launchers' one dispatch on the head dims (both files' kernels are templates on them).
template <typename F>
decltype(auto) ByDims(const SparseAttentionArgs& a, F&& f) {
  using I64 = std::integral_constant<int, 64>;
  using I128 = std::integral_constant<int, 128>;
  if (a.D == 64 && a.Dv == 64) return f(I64{}, I64{});
  if (a.D == 64 && a.Dv == 128) return f(I64{}, I128{});
  if (a.D == 128 && a.Dv == 64) return f(I128{}, I64{});
  return f(I128{}, I128{});
}

// bf16; D, Dv in {64, 128}; 1 <= H / Hkv <= 8.
bool SparseAttentionMmaSupported(const SparseAttentionArgs& a);

int SparseAttentionForwardMma(const SparseAttentionArgs& a, SparseOutRows o, float* lse, void* stream);
// Stages all H heads' queries of a token in shared memory: Hkv <= 64 (the launcher's rule).
int SparseAttentionProbsMma(const SparseAttentionArgs& a, const float* lse, float* probs, void* stream);
int SparseAttentionBackwardQueryMma(const SparseAttentionArgs& a, SparseRows dO, const float* lse, SparseOutRows dq,
                                    float* delta, void* stream);
int SparseAttentionBackwardKeysMma(const SparseAttentionArgs& a, SparseRows dO, const float* lse, const float* delta,
                                   const SparseKeyUnits& units, int64_t block_end, float* dk_acc, float* dv_acc,
                                   void* stream);

}  // namespace odyssey::kernels::cuda
