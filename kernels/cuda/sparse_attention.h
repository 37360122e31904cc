// Launchers of sparse attention over selected keys (kernels/cuda/sparse_attention.cu), the CUDA
// path of kernels::SparseAttention (kernels/dsa.h): query t of head h attends to the keys
// idx[b, t, :] (int32, -1 = no key) of its KV head h / G, G = H / Hkv.
//
// Three kernels, fp32 arithmetic on CUDA cores over fp32 or bf16 tensors (the gathered rows give
// ~3 FLOP per byte at G = 3: the work is bound by the gather, not by the FMAs):
//   - Forward: one block per (token, group of Gs heads sharing a KV head); each warp takes 32
//     selected keys at a time, one key per lane for the scores (the whole row against the
//     queries in shared memory), lanes across the value columns for P V, with an online softmax;
//     the four warps' partial results merge at the end. Writes o and the log-sum-exp.
//   - Backward, query side: the same walk recomputing p from the log-sum-exp; dq = sum ds k, and
//     delta = dO . o (in fp32, from the walk), which the key side needs.
//   - Backward, key side: one block per (aligned block of 4 keys, KV head) over the block's
//     units, as the caller builds them: a unit is one query's run of consecutive selection
//     entries in the block (keys strictly increasing, so at most 4), the run DSA's pool
//     selection makes of each selected pool. Each unit reads its query's q and dO rows once for
//     all its keys (the per-key form read them once per key: 4x the bytes under pools of 4).
//     The units are sorted by block, each block's in increasing entry order, so the sums are
//     deterministic. No atomics: a block owns its keys' rows of the fp32 accumulators dk, dv and
//     adds to them, so the caller can build and run the units a segment of queries at a time in
//     bounded memory.
//
// Raw device pointers, no CUDA or libtorch headers here. q, k, v, o, dO, dq: element strides for
// batch, head and token; the head dim contiguous; 16-byte aligned rows (SparseAttentionSupported
// says which shapes). S counts the query rows (of q, o, dO, dq, idx, lse, delta), Sk the key rows
// (of k, v, dk_acc, dv_acc): q may be a tile of a longer sequence's queries, its indices
// addressing k's rows. idx (B, S, W) int32 contiguous, entries in [-1, Sk); lse, delta (B, H, S)
// fp32 contiguous; dk_acc (B, Hkv, Sk, D), dv_acc (B, Hkv, Sk, Dv) fp32 contiguous. Each launcher returns the
// launch's cudaError_t as an int (0 = success). Only built with ODYSSEY_CUDA.
#pragma once

#include <cstdint>

namespace odyssey::kernels::cuda {

// Process-wide (set it before launching): bf16 launches of the shapes
// SparseAttentionMmaSupported takes run the tensor-core kernels of sparse_attention_mma.h (the
// default); off, every launch runs the CUDA-core kernels here (for comparison: benchmarks, tests).
void SetSparseAttentionTensorCores(bool enabled);
bool SparseAttentionTensorCores();
// Launches that took the tensor-core kernels so far (tests: the path ran).
int64_t SparseAttentionTensorCoreLaunches();

// D and Dv in {64, 128}; any G >= 1 (heads run in groups of 4, 3, 2 or 1, the largest that
// divides G).
bool SparseAttentionSupported(int64_t D, int64_t Dv);

struct SparseRows {
  const void* p;
  int64_t sb, sh, ss;  // element strides of batch, head, token
};
struct SparseOutRows {
  void* p;
  int64_t sb, sh, ss;
};

struct SparseAttentionArgs {
  bool bf16;  // every q, k, v, o, dO, dq tensor: bf16 (else fp32)
  SparseRows q, k, v;
  const int32_t* idx;      // (B, S, W), entries in [-1, Sk)
  int64_t B, H, Hkv, S, Sk, W, D, Dv;  // S query rows, Sk key rows
  float scale;
};

// o (B, H, S, Dv) strided; lse (B, H, S): the natural log-sum-exp of the scaled scores, -inf for
// a query with no valid index (whose o is 0).
int SparseAttentionForward(const SparseAttentionArgs& a, SparseOutRows o, float* lse, void* stream);

// probs (B, S, W) fp32 contiguous: the head-mean softmax probability of each selected key,
// (1 / H) sum_h exp(scale q_h . k_j - lse_h) over the row's valid keys, 0 at -1 entries and in
// rows without a valid key. v and Dv are not read (Dv must equal D for the dispatch). S counts the
// query rows given (a chunk of a longer sequence: the indices address k's Sk rows). lse (B, H, S),
// the forward's natural log-sum-exp of the same rows, or null: given, the kernel walks the
// selection once (the probabilities); null, twice (the log-sum-exp first).
int SparseAttentionProbs(const SparseAttentionArgs& a, const float* lse, float* probs, void* stream);

// dq (B, H, S, D) strided, delta (B, H, S) = dO . o, computed in fp32 as sum_j p_j (dO . v_j)
// (not from the rounded o).
int SparseAttentionBackwardQuery(const SparseAttentionArgs& a, SparseRows dO, const float* lse, SparseOutRows dq,
                                 float* delta, void* stream);

// Keys per aligned block of the key-side backward (a pool of DSA's indexer).
constexpr int kSparseKeyBlock = 4;

// The units of the query rows t0 .. t0 + rows - 1 (every batch row b): a unit starts at entry w
// of row (b, t) when idx[b, t, w] >= 0 and w == 0 or idx[b, t, w - 1] is not a smaller key of the
// same block (block = key / kSparseKeyBlock); it takes the entries after it while they are (at most
// kSparseKeyBlock).
// first[u] = (b * rows + t - t0) * W + w of unit u (int32), the units sorted by (b, block) and
// then by first; offsets (B * nb + 1) int64, nb = ceil(Sk / kSparseKeyBlock): the start of block
// b * nb + j's units in first.
struct SparseKeyUnits {
  const int64_t* offsets;
  const int32_t* first;
  int64_t t0, rows;
};

// Adds each key's dk, dv over its units to dk_acc, dv_acc, for the key blocks j < block_end.
int SparseAttentionBackwardKeys(const SparseAttentionArgs& a, SparseRows dO, const float* lse, const float* delta,
                                const SparseKeyUnits& units, int64_t block_end, float* dk_acc, float* dv_acc,
                                void* stream);

}  // namespace odyssey::kernels::cuda
