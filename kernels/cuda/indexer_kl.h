// The DSA indexer's KL loss over its selected pools (kernels::IndexerKlLoss, kernels/dsa.h) as
// CUDA kernels: bf16 indexer queries, pooled keys and head weights; the products on the tensor
// cores (mma.sync m16n8k16, fp32 accumulators), the softmax and the KL in fp32.
//
// One block per query row (128 threads, four warps, warp w the heads 8w .. 8w + 7); the row's kp
// selected pools 16 at a time: their pooled keys gathered into shared memory (cp.async), the
// per-head dots S = K_c Q^T, the logits sum_h w_h relu(S_h) / sqrt(DI). Forward: each row's KL
// (sum over the valid pools of target (log target - log softmax(logits)), 0 for a row without one)
// into kl_rows, which the caller sums. Backward: the same logits, then per chunk again the dots,
// ddots = [S > 0] dlog w (dlog = (softmax * sum(target) - target) * g / sqrt(DI) on the valid
// pools), dq = ddots^T K_c and dk = ddots Q on the tensor cores (ddots in two bf16 parts: ~16
// bits), dw = sum relu(S) dlog in fp32. dk is added to an fp32 accumulator with atomics (pools are
// shared by many rows), so its low bits depend on the order, as libtorch's index_add_ is; dq and dw
// are written once, each by one thread.
//
// Raw device pointers, no CUDA or libtorch headers here. Only built with ODYSSEY_CUDA.
#pragma once

#include <cstdint>

namespace odyssey::kernels::cuda {

struct IndexerKlArgs {
  const void* q;  // (B, HI, S, DI) bf16, DI contiguous, 16-byte aligned rows
  int64_t q_sb, q_sh, q_ss;
  const void* k;  // (B, P, DI) bf16, DI contiguous, 16-byte aligned rows
  int64_t k_sb, k_sp;
  const void* w;  // (B, S, HI) bf16 contiguous
  const int32_t* pool;  // (B, S, kp) contiguous, entries in [-1, P)
  const float* target;  // (B, S, kp) fp32 contiguous
  int64_t B, HI, S, P, DI, kp;
};

// HI a multiple of 8 up to 32, DI 64 or 128.
bool IndexerKlSupported(int64_t HI, int64_t DI);

// kl_rows (B, S) fp32: each row's KL.
int IndexerKlForward(const IndexerKlArgs& a, float* kl_rows, void* stream);

// g: the loss's gradient (one fp32 on the device). dq (B, HI, S, DI) bf16 contiguous and dw (B, S,
// HI) bf16 contiguous, written; dk_acc (B, P, DI) fp32 contiguous, added to.
int IndexerKlBackward(const IndexerKlArgs& a, const float* g, void* dq, void* dw, float* dk_acc, void* stream);

}  // namespace odyssey::kernels::cuda
