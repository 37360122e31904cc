// Kimi Delta Attention (KDA, ../shared/specs/hybrid-attention.md section 1): the gated delta rule
// with a per-channel decay. Two libtorch implementations: the naive recurrence (spec 1.6, the
// truth every other path is tested against) and the chunkwise-parallel form (spec 1.3) with its
// autograd backward (spec 1.4), which is the CPU path and the reference of the future CUDA kernel.
//
// Shapes (batch, heads, length, head dim, as kernels/attention.h orders them; the spec's table
// writes [B, T, H, K], the same tensors with heads and length swapped):
//   q, k  (B, H, T, K)    L2-normalised by the caller (the layer's job, spec 1.1)
//   v     (B, HV, T, V)   HV a multiple of H: value head h uses q/k head h / (HV / H)
//   g     (B, HV, T, K)   log of the per-channel decay, g <= 0 (alpha = exp(g) in (0, 1])
//   beta  (B, HV, T)      in (0, 1) (or (0, 2) with negative eigenvalues)
//   h0    (B, HV, K, V)   initial state, optional (undefined = zeros)
// Outputs: o (B, HV, T, V) in v's dtype, final state (B, HV, K, V) fp32 (fp64 for fp64 inputs).
// Recurrence (spec 1.2): S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
// o_t = S_t^T (scale q_t), scale = 1 / sqrt(K) unless given.
// Inside, everything is computed in fp32 (fp64 when any input is fp64): bf16 inputs are
// upcast, the output is rounded once.
// Thread safety: pure functions.
#pragma once

#include <torch/types.h>

#include <utility>

namespace odyssey::kernels {

struct KdaOptions {
  double scale = 0.0;       // on q; 0 = 1 / sqrt(K)
  int64_t chunk_size = 64;  // C of the chunked form; a positive multiple of 16 (spec: 32 or 64)
  // Tokens per segment of KdaChunked, a positive multiple of chunk_size: the chunk-parallel work
  // is batched over one segment's chunks, and the backward holds one segment's intermediates
  // (fp32: the recomputed chunk quantities, the per-chunk states, their gradients; some 60
  // tensors of (B, HV, segment, K), ~0.6 MB a token at 24 heads of 128, measured) at a time.
  int64_t segment = 32768;
};

// Returns (o, final state). Plain libtorch ops in a loop over t: differentiable by autograd
// (which then holds every per-token state: small sizes only).
// REQUIRES: shapes as in the file comment.
std::pair<torch::Tensor, torch::Tensor> KdaNaive(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, const torch::Tensor& g,
                                                 const torch::Tensor& beta, const torch::Tensor& h0,
                                                 const KdaOptions& options = {});

// Returns (o, final state), equal to KdaNaive up to rounding. Chunks of C tokens: inside a chunk
// the UT transform (WY representation) in parallel, between chunks a sequential fp32 state scan.
// Lengths that are not a multiple of C are padded inside with g = 0, beta = 0, k = v = q = 0
// tokens, which leave the state unchanged. Differentiable through a custom autograd Function whose
// forward keeps only the inputs (no copies) and the state entering each segment; its backward
// recomputes a segment's chunk quantities, reruns its state scan and runs the reverse scan of
// spec 1.4, segment by segment from the last. The final state's gradient (a state carried into a
// next call) flows back like o's. On CUDA fp32 compute with C in {32, 64}, K in {32, 64, 128}
// and V a multiple of 32, the two scans are CUDA kernels (SetKdaScanTensorCores below), the chunk
// quantities kernels/cuda/kda_intra.cu's and their backward kernels/cuda/kda_intra_backward.cu's
// (when FusedKernelsEnabled(); KdaIntraBackwardPath below); everything else is batched libtorch
// ops, on every device. Those chunk kernels read the caller's q, k, v and beta as they are (q, k,
// v all fp32 or all bf16, beta either; any batch/head/token strides with contiguous rows; q scaled
// as read) when q and k have the HV value heads already: no fp32 copy of a segment's inputs is
// made (KdaDirectInputRuns).
// g is read once, by its chunk-local cumulative sum in the compute dtype.
// REQUIRES: shapes as in the file comment; g <= 0 (the stability argument of spec 1.5 needs it;
// not checked per element).
std::pair<torch::Tensor, torch::Tensor> KdaChunked(const torch::Tensor& q, const torch::Tensor& k,
                                                   const torch::Tensor& v, const torch::Tensor& g,
                                                   const torch::Tensor& beta, const torch::Tensor& h0,
                                                   const KdaOptions& options = {});

// Process-wide (set it before the calls): whether the CUDA state scans and the backward's
// products over the states multiply on the tensor cores with TF32 operands and fp32 sums
// (default; kernels/cuda/kda_scan_tf32.cu: the state stays fp32, each product's operands keep 10
// mantissa bits, the class of fla's bf16 kernels and inside the spec's error bars) or in fp32:
// the scans on CUDA cores (kernels/cuda/kda_scan.cu), the products as batched fp32 libtorch
// matmuls. On the tensor cores the reverse scan forms Aqk^T dO itself and one kernel
// (KdaChunkGrads) takes the chunk quantities' gradients given the states. The intra-chunk
// kernels follow it too: the whole-chunk forward's Grams and W = T X, U = T Y
// (kernels/cuda/kda_intra.cu) and the intra-chunk backward's products run on the tensor cores
// under it (V a multiple of 8); their element-wise factors and the UT inverse stay fp32.
// Benchmarks and tests compare the two; without the CUDA kernels it changes nothing.
void SetKdaScanTensorCores(bool enabled);
bool KdaScanTensorCores();
// Tensor-core launches so far in this process: state scans (forward or reverse) and the chunk
// gradients' kernel.
int64_t KdaScanTensorCoreLaunches();

// Which code runs KdaChunked's intra-chunk backward (spec 1.4 steps 4-6) in the whole-chunk and
// the sub-block Gram forms (kElementwiseDiagonal always runs libtorch's autograd):
//  - kAuto (default): the CUDA kernel of kernels/cuda/kda_intra_backward.h for fp32 CUDA compute
//    of its sizes while FusedKernelsEnabled(); otherwise libtorch ops (by hand for the
//    whole-chunk form, autograd of the recomputed graph for the sub-block form);
//  - kLibtorch: libtorch ops on every device (what benchmarks and tests compare against);
//  - kKernelCodeOnHost, kKernelCodeOnHostReversed: on CPU tensors, the kernel's own block code
//    emulated on the CPU, each phase's threads in order or in reverse (tests: the CPU machines
//    check the kernel's arithmetic and its phase discipline; slow). CUDA tensors take kAuto's path.
// Process-wide; set it before training starts, not during a step.
enum class KdaIntraBackwardPath { kAuto, kLibtorch, kKernelCodeOnHost, kKernelCodeOnHostReversed };
void SetKdaIntraBackwardPath(KdaIntraBackwardPath path);
// Segments whose intra-chunk backward ran the kernel's block code (on CUDA or emulated) so far in
// this process: tests prove which path ran.
int64_t KdaIntraBackwardKernelRuns();
// Segments whose sub-block Gram form's chunk quantities (the forward, and the backward's
// recompute) ran the same block code's forward: under the same paths, for the sub-block form.
int64_t KdaSubBlockForwardKernelRuns();
// Kernel passes over a segment (the chunk quantities, in the forward or the backward's recompute,
// and the intra-chunk backward) that read the caller's q, k, v and beta as they are, fp32 or
// bf16 with q scaled as read, so far in this process: no fp32 copies of the segment's inputs were
// made for them. Inputs with HV > H (q and k expanded) and fp64 compute are copied (prepared).
int64_t KdaDirectInputRuns();
// The intra backward kernel passes that wrote the segment's input gradients into the caller's
// gradient tensors themselves (bf16 or fp32, each element once), with no fp32 copies of them.
int64_t KdaDirectGradientRuns();
// Process-wide (set before the calls; benchmarks compare): whether the chunk kernels read the
// caller's inputs directly where they can (default on; off: the prepared fp32 copies).
void SetKdaDirectInputs(bool enabled);
// Process-wide (set before the calls; benchmarks compare): whether the state scans read qg, kg and
// W as bf16 (default on): the forward's, and, where the intra-chunk backward is the kernel's, the
// backward's recompute of the states and its reverse scan. The whole-chunk intra kernel rounds
// them as it writes them. Their products keep TF32 arithmetic: a bf16 value is its TF32 operand
// as it is, with 7 mantissa bits where the TF32 rounding of the fp32 value keeps 10; U, Aqk, the
// state and every sum stay fp32, and the backward recomputes the states from the same bf16
// operands the forward's scan read, keeping the per-chunk states and their gradients (which only
// the chunk gradients' kernel reads, as TF32 operands) in bf16 too. It halves what the scans read
// for those three tiles and what the chunk gradients read of the states
// (bench/kda_operand_precision.py: the output's relative RMS error against the fp32 recurrence
// 1.25e-3 where TF32 gives 4.0e-4; the spec's bar is 5e-3). Only with the tensor-core scans
// (SetKdaScanTensorCores) and the CUDA kernels; elsewhere it changes nothing.
void SetKdaScanBf16Operands(bool enabled);
bool KdaScanBf16Operands();
// The value columns a block of the forward's bf16-operand scan owns: 32 (default) or 16 (twice
// the blocks, two a multiprocessor; for C = 64 and K >= 64, else the scans keep fp32 operands).
// False, and nothing changes, for any other value.
bool SetKdaScanValueBlock(int columns);
// State scans (forward or reverse) that read bf16 operands so far in this process (tests prove
// which path ran).
int64_t KdaBf16OperandScans();
// Process-wide (set before the calls; benchmarks compare): whether the intra-chunk backward kernel
// reads the UT inverse T = (I + A_kk)^-1 that the backward's recompute of the segment computed
// (the kernel's, kept as one fp32 C x C tile a chunk: 0.2 GB a 32K-token segment at 24 heads, only
// while that segment's backward runs) instead of inverting again (default on). The spec lets the
// backward keep T; the inverse is the kernel's serial part (forward substitution, then 2 (C / 16
// - 1) phases each ending at a barrier). Whole-chunk Gram form only; elsewhere nothing changes.
void SetKdaIntraBackwardReadsInverse(bool enabled);
bool KdaIntraBackwardReadsInverse();
// Intra backward kernel passes (segments; on CUDA or emulated) that read a given T so far in this
// process (tests prove which path ran).
int64_t KdaIntraBackwardInverseReads();
// Intra kernel launches (kernels/cuda/kda_intra.h) that read q, k and v one element at a time
// because a base or a stride is not aligned to a 4-element vector (cuda::KdaIntraVectorLoads) so
// far in this process; the aligned inputs every caller here passes take the vector loads.
int64_t KdaIntraElementLoadLaunches();

// M[..., i, j] = sum_d x[..., i, d] y[..., j, d] exp(G[..., i, d] - G[..., j, d]) for j < i
// (strict) or j <= i, zero above. x, y, G (..., C, K) with C a multiple of 16 and G
// non-increasing along C (a cumulative sum of g <= 0). Three forms, one chosen per call by one
// reduction of G (KdaDecayedGramForm):
//  - kWholeChunk, when no chunk decays by more than 60 (e-folds) in any channel: the whole C x C
//    product is one matmul against the chunk's first row, exp(G_i - G_0) * exp(G_0 - G_j), the
//    query factor in [e^-60, 1], the key factor in [1, e^60] (finite, exact to rounding in fp32),
//    then masked;
//  - otherwise by 16-token sub-blocks (spec 1.5), every factor against the block's first row r:
//    when no sub-block decays by more than 60 (kSubBlocks) a block row is one matmul over the
//    keys before it and its own; else (kElementwiseDiagonal) the keys before it are one matmul
//    (both factors <= 1) and the diagonal block is element-wise, forming only exponents <= 0.
// Each row's entries depend on no later token, not even by rounding (a reference row after a
// query would make its result depend on the tokens between them).
// Every form's rounding is of the order of the element-wise definition's. Exposed for the test of
// intermediates.
enum class KdaGramForm { kWholeChunk, kSubBlocks, kElementwiseDiagonal };
KdaGramForm KdaDecayedGramForm(const torch::Tensor& G);
torch::Tensor KdaDecayedGram(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& G, bool strict);

}  // namespace odyssey::kernels
