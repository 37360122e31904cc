// The DSA dense warm-up's KL target (kernels::DenseWarmupKl, kernels/dsa.h) as CUDA kernels: the
// main attention's causal probabilities of query rows [t0, t0 + n), summed over the heads and
// within each pool of 4 keys, without ever forming the (H, n, S) scores. bf16 q and k, the
// products q k^T on the tensor cores (mma.sync m16n8k16, fp32 accumulators), exp and sums in fp32:
// the operands and accumulation of the libtorch path's at::bmm(..., out_dtype=fp32).
//
// Two passes over the keys, flash-style, each a grid of (key tile of 128, row tile of 16, batch)
// blocks of four warps (warp w the tile's keys 32w .. 32w + 31, held as mma B fragments in
// registers across the G = H / Hkv query heads of one KV head; the query heads one at a time
// through shared memory):
//   1. WarmupTargetLse: each (head, row)'s log-sum-exp over the tile's visible keys (key <= row),
//      -inf where none is; the caller takes the log-sum-exp over the tiles.
//   2. WarmupTargetPools: sum_h sum_{key in pool p} exp(scale q_h . k - lse_h) for each pool whose
//      last key 4p + 3 is visible from the row, 0 for the others. The caller normalises each
//      row (the sum over heads is H times the head mean: the same target once normalised).
//
// Raw device pointers, no CUDA or libtorch headers here. Only built with ODYSSEY_CUDA.
#pragma once

#include <cstdint>

namespace odyssey::kernels::cuda {

struct WarmupTargetArgs {
  const void* q;  // (B, H, S, D) bf16, D contiguous, 16-byte aligned rows
  int64_t q_sb, q_sh, q_ss;
  const void* k;  // (B, Hkv, S, D) bf16, D contiguous, 16-byte aligned rows; q head h reads k head h / (H / Hkv)
  int64_t k_sb, k_sh, k_ss;
  int64_t B, H, Hkv, S, D;
  int64_t t0, n;  // the query rows [t0, t0 + n), n >= 1, t0 + n <= S
  float scale;    // on q . k
};

// D 128, Hkv dividing H, B <= 65535.
bool WarmupTargetSupported(int64_t B, int64_t H, int64_t Hkv, int64_t D);

// The key tiles pass 1 writes per row: ceil((t0 + n) / 128).
int64_t WarmupTargetKeyTiles(const WarmupTargetArgs& a);

// part (B, H, n, WarmupTargetKeyTiles(a)) fp32 contiguous: each tile's log-sum-exp of row t0 + r's
// scale q . k over the tile's keys up to the row (-inf where the tile has none).
int WarmupTargetLse(const WarmupTargetArgs& a, float* part, void* stream);

// lse (B, H, n) fp32 contiguous: each (head, row)'s log-sum-exp over its visible keys. out (B, n,
// pv) fp32 contiguous, pv <= (t0 + n) / 4: out[b, r, p] = sum_h sum_{j < 4} exp(scale q_h[t0 + r] .
// k[4p + j] - lse[b, h, r]) where 4p + 3 <= t0 + r, else 0.
int WarmupTargetPools(const WarmupTargetArgs& a, const float* lse, float* out, int64_t pv, void* stream);

}  // namespace odyssey::kernels::cuda
