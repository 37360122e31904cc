// DeepSeek Sparse Attention (DSA, ../shared/specs/hybrid-attention.md section 2): the lightning
// indexer's scores, the per-query top-k selection of keys (naive, and query-block chunked with a
// streaming top-k), GLM-5.3-Flash's pooled keys (spec 2.4: pools of 4 tokens plus the tail), and
// attention over the selected keys with its backward. libtorch references: the CPU path and what
// the future CUDA kernels are tested against.
//
// Shapes (batch, heads, length, head dim, as kernels/attention.h orders them):
//   q_idx  (B, HI, S, D)   indexer queries, HI index heads
//   k_idx  (B, P, D)       indexer keys, one shared head: P = S token keys (pool 1), or the
//                          P = floor(S / 4) pooled keys of KeyPool4 (pool 4)
//   w      (B, S, HI)      per-query head weights, the spec's w_{t,j} with H_I^-1/2 included
// The selections take a tile of queries too: q_idx (B, HI, n, D) and w (B, n, HI) the queries at
// absolute positions query_offset .. query_offset + n - 1 of a sequence whose every key item is in
// k_idx (DsaIndexerOptions::query_offset); what the file says of query t is then of position t.
// Score I[b, t, p] = sum_j w[b, t, j] * relu(q_idx[b, j, t] . k_idx[b, p]) / sqrt(D) (fp32, or
// fp64 for fp64 inputs). Key item p covers tokens [pool p, pool p + pool - 1] and is visible to
// query t iff pool p + pool - 1 <= t (causal; for pool 1: p <= t).
// Selection: indices int32 (B, S, top_k), the visible items in the total order (higher score
// first; equal scores: lower index first), min(top_k, #visible) of them, then -1 padding. The
// order is a rule so that the naive and the streaming selection agree exactly under ties.
// Thread safety: pure functions.
#pragma once

#include <torch/types.h>

namespace odyssey::kernels {

struct DsaIndexerOptions {
  int64_t top_k = 2048;      // items kept per query (GLM with pool 4: 512 pools = 2048 tokens)
  int64_t pool = 1;          // tokens per key item: 1 (token keys, V3.2) or 4 (pooled keys, GLM)
  int64_t query_block = 64;  // queries scored together by the chunked selection
  int64_t key_block = 256;   // key items per step of its streaming top-k
  // CUDA path (kernels/cuda/dsa_indexer.h): bytes of fp32 scores of one chunk of queries against
  // the items they see; the chunk is sized to fit (at least 64 queries). Working memory of the
  // selection besides its output.
  int64_t workspace_bytes = int64_t{256} << 20;
  // Absolute position of the first query of q_idx and w (a query tile of a longer sequence: k_idx
  // holds all its key items, visibility counts from position 0). 0: the queries start the
  // sequence. The tile's selection equals rows query_offset.. of the whole sequence's exactly
  // (both paths: each row is scored and selected on its own).
  int64_t query_offset = 0;
};

// Scores of queries q_idx (B, HI, Sq, D), w (B, Sq, HI) against key items k_idx (B, P, D):
// (B, Sq, P) in the compute dtype, no mask. The one score function both selections call.
torch::Tensor IndexerScores(const torch::Tensor& q_idx, const torch::Tensor& k_idx, const torch::Tensor& w);

// Naive selection: forms the (B, n, P) score matrix (small sizes only), masks it causally at the
// queries' absolute positions, sorts each row. Returns (B, n, top_k) int32 for q_idx (B, HI, n, D).
// REQUIRES: shapes as in the file comment; top_k >= 1; pool >= 1; query_offset >= 0.
torch::Tensor IndexerTopKNaive(const torch::Tensor& q_idx, const torch::Tensor& k_idx, const torch::Tensor& w,
                               const DsaIndexerOptions& options);

// Chunked selection, equal to IndexerTopKNaive. Two paths:
//   - CUDA kernels (kernels/cuda/dsa_indexer.h) while FusedKernelsEnabled(), for bf16 CUDA q and
//     k with D in {64, 128}, HI <= 64, top_k <= 4096: chunks of queries scored on the tensor
//     cores into a workspace of at most workspace_bytes (never the (S, P) matrix at length;
//     the chunks planned over the absolute positions of the tile, so a tile late in the sequence
//     takes fewer rows a chunk),
//     each row's top_k found by an exact radix select and sorted by the rule. Scores are fp32
//     sums of bf16 products in another order than the libtorch path's, so near-equal scores may
//     order differently; exactly representable scores select identically.
//   - libtorch otherwise: blocks of query_block queries, each scored against key_block items at
//     a time (only the items its last query can see), a running top_k merged with each key
//     block. Working memory O(HI * query_block * key_block + query_block * (top_k + key_block))
//     per batch row.
// Returns (B, n, top_k) int32, row i the selection of position query_offset + i.
// REQUIRES: as IndexerTopKNaive; query_block, key_block >= 1; workspace_bytes >= 1.
torch::Tensor IndexerTopK(const torch::Tensor& q_idx, const torch::Tensor& k_idx, const torch::Tensor& w,
                          const DsaIndexerOptions& options);

// GLM's pooled keys (spec 2.4): k (B, S, D) per-token indexer keys, z (B, S, D) gate logits, bias
// (4, D) per-slot bias. Pool p = tokens 4p..4p+3 counted from the row's position 0; only complete
// pools. K[b, p, d] = sum_j softmax_j(z[b, 4p+j, d] + bias[j, d]) k[b, 4p+j, d], computed in
// fp32 (fp64 for fp64 inputs) and returned in k's dtype (bf16 inputs: rounded to bf16, as the
// spec says). Differentiable by autograd. Returns (B, floor(S / 4), D).
torch::Tensor KeyPool4(const torch::Tensor& k, const torch::Tensor& z, const torch::Tensor& bias);

// Token indices of a pool selection (spec 2.4): pool_idx (B, n, kp) int32 from IndexerTopK with
// pool 4, row i the selection of absolute position t = t0 + i (a query tile's rows: t0 its
// query_offset). Row t: each selected pool p expanded to 4p..4p+3 (in selection order), then the
// tail tokens 4 floor((t+1)/4) .. t (0 to 3 of them), then -1: (B, n, 4 kp + 3) int32, with
// 4 min(kp, floor((t+1)/4)) + (t+1) mod 4 valid entries; equal to rows t0.. of the whole
// sequence's expansion. libtorch on pool_idx's device, in blocks of rows.
// REQUIRES: pool_idx's valid entries come first in each row (as the selections return them);
// t0 >= 0.
torch::Tensor ExpandPoolSelection(const torch::Tensor& pool_idx, int64_t t0 = 0);

// Attention of each query over its selected keys only: for query t of head h,
// softmax_j(scale q[h, t] . k[h', idx[t, j]]) over the valid j (idx >= 0), weights on v[h', idx],
// h' = h / (H / Hkv) (GQA; MQA when Hkv = 1). Equal to dense attention masked to the same key set.
// q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), indices (B, Sq, W) int32 shared by all
// heads (entries index k's Sk rows: q may be a tile of a longer sequence's queries, Sq != Sk);
// returns (B, H, Sq, Dv) in q's dtype, differentiable w.r.t. q, k, v (dk, dv of k's, v's shape).
// A query with no valid index gets 0. Two paths, each one forward and one backward, those of
// SparseAttentionForward and SparseAttentionBackward below (an autograd Function over them that
// keeps q, k, v, the indices and the log-sum-exp):
//   - CUDA kernels (kernels/cuda/sparse_attention.h) while FusedKernelsEnabled(), for CUDA
//     tensors q, k, v all fp32 or all bf16 with D and Dv in {64, 128}, strided q, k, v read in
//     place (no copies): bf16 with at most 8 heads a KV head on the tensor cores (bf16 products,
//     fp32 sums; kernels/cuda/sparse_attention_mma.h) while SparseTensorCores() is on, else fp32
//     arithmetic on CUDA cores. The backward
//     recomputes the probabilities from the log-sum-exp (B, H, Sq), and computes dk, dv by
//     aligned blocks of 4 keys over the queries that selected keys of each block, a query's run
//     of entries in one block (a selected pool) read once for all of them: the runs sorted by
//     block (a stable sort, so the sums are deterministic) at most `backward_pairs` (query, key)
//     entries at a time, with fp32 accumulators (B, Hkv, Sk, D + Dv).
//   - libtorch otherwise (the CPU path and the reference): computed in fp32 (fp64 for fp64
//     inputs), the gathered keys and probabilities block by block (query_block queries at a
//     time), recomputed in backward.
// REQUIRES: indices in [-1, Sk) (checked), without duplicates in a row (a duplicate would count
// its key twice; not checked); scale > 0 or 0 for 1 / sqrt(D); query_block >= 1; backward_pairs in
// [1, 2^31 - 1].
torch::Tensor SparseAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& indices, double scale = 0.0, int64_t query_block = 128,
                              int64_t backward_pairs = int64_t{1} << 27);

// Process-wide (set it before the calls): whether the CUDA path's bf16 sparse attention runs on
// the tensor cores (default) or on CUDA cores (SparseAttention above). Benchmarks and tests compare
// the two; where the CUDA kernels are not built it changes nothing (FusedKernelsBuilt()).
void SetSparseTensorCores(bool enabled);
bool SparseTensorCores();
// Sparse attention launches that ran on the tensor cores so far (0 without the CUDA kernels).
int64_t SparseTensorCoreLaunches();

// SparseAttention's forward and backward without autograd, for a caller that runs its own
// backward a query tile at a time (the whole sequence's k, v against one tile's q and indices),
// summing the key-side gradients over the tiles. Neither builds a graph (both run under
// NoGradGuard); both take the path SparseAttention would for the same q, k, v, and what one
// returns the other accepts on either path (lse has one meaning and dtype rule on both).
//
// Forward: out (B, H, Sq, Dv) in q's dtype; lse (B, H, Sq), the natural log-sum-exp of each
// query's scaled scores over its valid indices, -inf where it has none (its out is 0); fp32
// (fp64 for fp64 inputs).
// REQUIRES: as SparseAttention.
struct SparseAttentionResult {
  torch::Tensor out;  // (B, H, Sq, Dv)
  torch::Tensor lse;  // (B, H, Sq)
};
SparseAttentionResult SparseAttentionForward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                             const torch::Tensor& indices, double scale = 0.0,
                                             int64_t query_block = 128);

// Backward of the forward above for grad_out (B, H, Sq, Dv) (any floating dtype): returns dq
// (B, H, Sq, D) in q's dtype and ADDS dk, dv into dk_acc (B, Hkv, Sk, D), dv_acc (B, Hkv, Sk, Dv),
// so tiles of queries sum into one pair of accumulators (the caller zeroes them once). The
// probabilities come from lse (the forward's, not recomputed), and dO . o from the
// probabilities (sum_j p_j dO . v_j), so the forward's out is not needed.
// REQUIRES: as SparseAttention; lse as SparseAttentionForward returned it for these q, k, v,
// indices and scale; dk_acc, dv_acc contiguous, on q's device, fp32 (fp64 for fp64 inputs: the
// dtype of lse).
torch::Tensor SparseAttentionBackward(const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const torch::Tensor& indices, const torch::Tensor& lse,
                                      double scale, torch::Tensor& dk_acc, torch::Tensor& dv_acc,
                                      int64_t query_block = 128, int64_t backward_pairs = int64_t{1} << 27);

// Head-mean attention probabilities at the selected keys, for the indexer's KL target (spec 2.3):
// P[b, t, j] = (1 / H) sum_h softmax_j(scale q[h, t] . k[h', idx[t, j]]) over the row's valid j
// (h' = h / (H / Hkv)), 0 at -1 entries and in rows without a valid key. q (B, H, Sq, D) may be
// a chunk of a longer sequence's queries, idx (B, Sq, W) its rows (indices into k's Sk rows);
// k (B, Hkv, Sk, D). No gradient. Returns (B, Sq, W) in the compute dtype (fp32; fp64 for fp64
// inputs). `lse` (B, H, Sq) in the compute dtype, optional: the same rows' natural log-sum-exp
// as SparseAttentionForward returns it; given, it is used instead of computed (one walk over the
// selection less). CUDA kernel (SparseAttentionProbs of cuda/sparse_attention.h: two walks over the
// selection per head group, one with lse, deterministic) under the conditions of SparseAttention's,
// else libtorch in blocks of query_block queries (the gathered keys of one block at a time).
// REQUIRES: indices in [-1, Sk) (checked) without duplicates in a row; query_block >= 1.
torch::Tensor SparseAttentionProbs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& indices,
                                   double scale = 0.0, int64_t query_block = 64,
                                   const torch::Tensor& lse = torch::Tensor());

// The indexer KL's formula, shared by its sparse stage (IndexerKlLoss) and the model's dense
// warm-up: MaskedLogSoftmax is the log-softmax of logits (B, n, items) over the valid entries,
// rows without a valid entry getting finite values (logits 0) so that no NaN reaches a backward;
// KlSum is sum of target (log target - logp) over the entries where target > 0 (target 0 off the
// valid entries; 0 log 0 = 0). Differentiable by autograd.
torch::Tensor MaskedLogSoftmax(const torch::Tensor& logits, const torch::Tensor& valid);
torch::Tensor KlSum(const torch::Tensor& target, const torch::Tensor& logp);

// The indexer's KL loss of the dense warm-up (spec 2.3), summed over rows: row t's target is the
// main attention's probabilities (softmax(q k^T / sqrt(D)) over the keys up to t, averaged over
// the H heads), summed within each pool of 4 keys over the pools visible from t (pool p when
// 4p + 3 <= t) and L1-normalised; its prediction the log-softmax of the indexer's scores
// (IndexerScores) over the same pools; rows without a visible pool add 0. q_idx (B, HI, S, DI),
// k_idx (B, S / 4, DI), w (B, S, HI): differentiable; q (B, H, S, D), k (B, Hkv, S, D) the main
// attention's, no gradient. A custom autograd Function over query_block rows at a time, so memory
// is one block's transients: with grad mode on and an input requiring a gradient, its forward
// forms each block's gradients by hand as it goes (the main attention's target formed once) and
// keeps only the three gradients, which its backward scales; otherwise the forward forms the
// value alone. (One autograd graph over all blocks keeps HI fp32 dot products per (row, pool)
// pair: ~9 GB for one DSA layer of hybrid-3b at 16K, ~140 GB at 64K; DenseWarmupKlReference
// below is the same sum by autograd, block by block, for tests.) fp32 (fp64 for fp64 inputs); a
// 0-d tensor. DenseWarmupKlBlock: a block size for S tokens that keeps the block's transients
// near 512 MiB of each kind (at most 1024 rows); with the target by the CUDA kernels (no score
// rows) the indexer's alone, near 2 GiB of each kind: 16x the rows for hybrid-3b. DenseWarmupKlBlockFor: that size for
// these tensors, knowing which path their device and dtypes take.
torch::Tensor DenseWarmupKl(const torch::Tensor& q_idx, const torch::Tensor& k_idx, const torch::Tensor& w,
                            const torch::Tensor& q, const torch::Tensor& k, int64_t query_block);
torch::Tensor DenseWarmupKlReference(const torch::Tensor& q_idx, const torch::Tensor& k_idx, const torch::Tensor& w,
                                     const torch::Tensor& q, const torch::Tensor& k, int64_t query_block);
int64_t DenseWarmupKlBlock(int64_t S, int64_t heads, int64_t index_heads, bool target_by_kernels = false);
int64_t DenseWarmupKlBlockFor(const torch::Tensor& q_idx, const torch::Tensor& q, const torch::Tensor& k);

// The indexer's KL loss over its selected pools (spec 2.3, sparse stage), summed over rows:
// sum_t sum_i target[t, i] (log target[t, i] - log softmax_i(I[t, pool_idx[t, i]])) over the
// valid i (pool_idx >= 0), I the score of IndexerScores; rows without a valid pool add 0. q_idx
// (B, HI, S, D), k_idx (B, P, D), w (B, S, HI): differentiable; pool_idx (B, S, kp) int32,
// target (B, S, kp) (0 at invalid entries; each row sums to 1 or 0), not. A custom autograd
// Function that keeps only its inputs and recomputes the gathered keys query_block rows at a
// time in backward, so memory does not grow with the sequence (an autograd graph per block
// would keep ~256 KB of gathered keys per token). Computed in fp32 (fp64 for fp64 inputs);
// returns a 0-d tensor of that dtype.
// REQUIRES: the shapes above; pool_idx entries in [-1, P); query_block >= 1.
torch::Tensor IndexerKlLoss(const torch::Tensor& q_idx, const torch::Tensor& k_idx, const torch::Tensor& w,
                            const torch::Tensor& pool_idx, const torch::Tensor& target, int64_t query_block = 256);

}  // namespace odyssey::kernels
