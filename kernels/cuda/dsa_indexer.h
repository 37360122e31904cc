// Launchers of the lightning indexer's selection (kernels/cuda/dsa_indexer.cu), the CUDA path of
// kernels::IndexerTopK (kernels/dsa.h): for each query t, the top_k key items by the score
// I[t, p] = sum_j w[t, j] relu(q_j[t] . k[p]) / sqrt(D) among the items it sees, in the order of
// dsa.h's rule (higher score first, equal scores lower index first), then -1.
//
// Two kernels per chunk of query rows, the caller looping over the sequence:
//   - Scores: bf16 tensor-core products (mma.sync m16n8k16, fp32 accumulators) of a 64-query x
//     128-item tile (the keys held in registers across heads), one index head at a time, each head's relu'd product weighted by w and
//     summed in registers: the (rows, items) fp32 scores go to a workspace, the per-head
//     products never leave the multiprocessor. Tiles no query of the block sees are skipped.
//   - Select: one block a row; an exact radix select of the top_k-th largest score: two passes
//     of 8 bits over the row's visible items, then one that gathers the items above the 16 bits
//     found and those sharing them, sorted in shared memory where they are few (at most 2048;
//     otherwise two more radix passes, and the items above the top_k-th score and the
//     lowest-index ones equal to it gathered); a bitonic sort of (score, index) pairs puts the
//     selection into the rule's order.
//     Deterministic; no state between rows.
// The workspace bounds the memory: rows x ld fp32 for a chunk, ld >= the chunk's visible items.
//
// Raw device pointers, no CUDA or libtorch headers here. Each launcher returns the launch's
// cudaError_t as an int (0 = success). Only built with ODYSSEY_CUDA.
#pragma once

#include <cstdint>

namespace odyssey::kernels::cuda {

// D (index head dim) in {64, 128}, HI (index heads) in [1, 64], top_k in [1, 4096].
bool IndexerSelectSupported(int64_t D, int64_t HI, int64_t top_k);

// The multiple of items every workspace row stride (ld) must be.
constexpr int64_t kIndexerItemTile = 128;

// Positions are absolute (visibility counts from the sequence's position 0); q, w and out hold
// the rows of positions q0 .. q0 + S - 1 (a query tile of the sequence: q0 its first position).
struct IndexerChunk {
  const void* q;          // bf16 index queries of one batch row: position t, head j, dim d at
                          // q + j*q_sh + (t - q0)*q_ss + d
  int64_t q_sh, q_ss;     // element strides of head and token (multiples of 8; q 16-byte aligned)
  const void* k;          // bf16 key items of that batch row: (P, D), row p at k + p*k_ss
  int64_t k_ss;           // a multiple of 8
  const float* w;         // (S, HI) fp32 contiguous head weights of that batch row, row t - q0
  int64_t S, P, D, HI, pool, top_k;
  int64_t q0;             // position of row 0 of q, w and out
  int64_t t0, rows;       // the chunk: positions t0 .. t0 + rows - 1, within q0 .. q0 + S - 1
  float* scores;          // workspace (rows, ld) fp32
  int64_t ld;             // >= min(P, (t0 + rows) / pool), a multiple of kIndexerItemTile
  int32_t* out;           // (S, top_k) int32 of that batch row; rows t0 - q0.. written
};

// Scores of the chunk's rows against the items the chunk's last query sees.
int IndexerScores(const IndexerChunk& c, void* stream);
// The chunk's selections from its scores.
int IndexerSelect(const IndexerChunk& c, void* stream);

}  // namespace odyssey::kernels::cuda
