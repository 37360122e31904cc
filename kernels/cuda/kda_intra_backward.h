// Chunked KDA's backward through the chunk-local quantities, whole-chunk or sub-block Gram form
// (`sub_blocks`): spec 1.4 steps 4-6, what kernels/kda.cc's IntraBackward computes from ~40 libtorch ops over (B, HV, N,
// C, K) fp32 tensors, in one thread block of 512 threads per (batch x head, chunk). The block
// recomputes the chunk's factors (Ep, Em, kp, km, qp, X, Y), the Gram L_kk and the UT inverse T
// = (I + diag(beta) L_kk)^-1 from q, k, v, beta and G (of the forward's quantities it may read T,
// the one whose recompute costs barriers: KdaIntraBackwardArgs::T), then
//   dT = dW X^T + dU Y^T, dX = T^T dW, dY = T^T dU, dA_kk = strict_lower(-T^T dT T^T),
//   dL = diag(beta) dA_kk, dA = lower(dAqk), dkp = dL km, dqp = dA km, dkm = dL^T kp + dA^T qp,
//   dq = dqp Ep + dqg eG, dk = dkp Ep + dkm Em + dX beta eG + dkg EC, dv = dY beta,
//   dbeta = rowsum(dA_kk L_kk) + rowsum(dX k eG) + rowsum(dY v),
//   dG = dqp qp + dkp kp - dkm km + dX X - dkg kg + dqg qg (+ the last row's sum of dkg kg and
//   deGC eGC), dg = the reverse cumulative sum of dG over the chunk's rows,
// all in fp32 (sums in another order than libtorch's).
//
// The block's code is kernels/cuda/kda_intra_backward_body.h, plain C++ that the CUDA kernel
// and kernels/kda.cc's host emulation (tests: the same code, thread by thread between barriers,
// on the CPU) both compile.
//
// Raw pointers. q, k, v, beta (fp32 or bf16, q times q_scale as read) and G (fp32) exactly as
// KdaIntraArgs (kernels/cuda/kda_intra.h); the rest fp32:
// the gradients of the chunk quantities contiguous: dqg, dkg, dW (BH, N, C, K), dU (BH, N, C,
// V), dAqk (BH, N, C, C), deGC (BH, N, K). The outputs, the input gradients, go where the caller
// says (KdaGradOut: (B, HV, L, .) by batch, head and token strides, rows contiguous, rows past L
// not written): dq, dk, dv in q's dtype (fp32 or bf16, as q, k, v are), dg and dbeta fp32 or bf16
// each; dq is q's gradient as read times dq_scale.
#pragma once

#include <cstdint>

#include "kernels/cuda/kda_intra.h"

namespace odyssey::kernels::cuda {

// An input gradient as it leaves the kernel: element (b, h, t, d) at b sb + h sh + t st + d of p,
// fp32 or bf16 (`bf16`; for dq, dk and dv it must be q's dtype).
struct KdaGradOut {
  void* p = nullptr;
  int64_t sb = 0, sh = 0, st = 0;
  bool bf16 = false;
};

struct KdaIntraBackwardArgs {
  const void *q, *k, *v, *beta;  // fp32 or bf16 (`bf16`)
  const float* G;
  int64_t q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st, b_sb, b_sh, b_st;
  int64_t B, HV, N, C, K, V, L;
  const float *dqg, *dkg, *dW, *dU, *dAqk, *deGC;
  KdaGradOut dq, dk, dv, dg, dbeta;
  // The Grams' form (kernels/kda.h KdaGramForm): false the whole-chunk form (factors against the
  // chunk's first row), true the sub-block form (against each 16-row block's first row; the
  // chunk may decay by any amount, a block by at most 60 e-folds).
  bool sub_blocks;
  // The products on the tensor cores (TF32 operands, fp32 sums) where the form takes it
  // (kda_intra_backward_body.h TensorCoreForm: the whole-chunk form, V a multiple of 8); the
  // element-wise work, the UT inverse's substitutions and every sum stay fp32.
  bool tf32 = false;
  uint8_t bf16 = 0;     // kKdaBf16* bits (kernels/cuda/kda_intra.h): which of q, k, v, beta are bf16
  float q_scale = 1.f;  // q as read is q * q_scale
  float dq_scale = 1.f;  // dq leaves as q's gradient times this (q_scale: the caller's unscaled q's)
  // The whole-chunk form only (not with sub_blocks): the chunks' UT inverse T (BH, N, C, C) fp32,
  // as the forward kernel wrote it from the same inputs (KdaIntraArgs::T_out), starting on 16
  // bytes. The block reads it instead of inverting (A_kk's substitutions: 1 + 2 (C / 16 - 1)
  // phases and their barriers); null: the block inverts.
  const float* T = nullptr;
};

// Whether the gradients' destinations are set and dq, dk and dv take q's dtype, as the block code
// writes them.
inline bool KdaGradOutsValid(const KdaIntraBackwardArgs& a) {
  const bool in16 = (a.bf16 & kKdaBf16Q) != 0;
  for (const KdaGradOut* o : {&a.dq, &a.dk, &a.dv, &a.dg, &a.dbeta}) {
    if (o->p == nullptr) return false;
  }
  return a.dq.bf16 == in16 && a.dk.bf16 == in16 && a.dv.bf16 == in16;
}
// C in {32, 64}, K in {32, 64, 128}, V a multiple of 4 up to 128 (KdaIntraSupported's sizes).
inline bool KdaIntraBackwardSupported(int64_t C, int64_t K, int64_t V) {
  return (C == 32 || C == 64) && (K == 32 || K == 64 || K == 128) && V >= 4 && V <= 128 && V % 4 == 0;
}
// The block's threads.
inline constexpr int kKdaIntraBackwardThreads = 512;

// The CUDA kernel (only built with ODYSSEY_CUDA). Returns the launch's cudaError_t as an int.
int KdaIntraBackward(const KdaIntraBackwardArgs& args, void* stream);
// The same block code on the CPU over host pointers (kernels/kda_intra_backward_host.cc, built
// on every machine): the blocks one after another, each phase's threads one after another (in reverse
// order with `reverse_threads`), shared memory starting as NaN. For tests; slow.
void KdaIntraBackwardOnHost(const KdaIntraBackwardArgs& args, bool reverse_threads);

// The sub-block Gram form's chunk-local quantities (what KdaIntraForward writes for the
// whole-chunk form, without its cache: qg, kg, W, U, Aqk, eGC), every Gram factor against its
// row's 16-row block's first row; the same sizes, one block of kKdaIntraBackwardThreads threads
// per (batch x head, chunk), the block code of kda_intra_backward_body.h (sub_forward). The CUDA
// kernel (ODYSSEY_CUDA builds) and its emulation on the CPU (every build).
int KdaIntraSubBlockForward(const KdaIntraArgs& args, void* stream);
void KdaIntraSubBlockForwardOnHost(const KdaIntraArgs& args, bool reverse_threads);

}  // namespace odyssey::kernels::cuda
