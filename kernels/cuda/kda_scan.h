// Launchers of the sequential part of chunked KDA (kernels/cuda/kda_scan.cu): the inter-chunk
// fp32 state scan of ../shared/specs/hybrid-attention.md 1.3 steps 3-4 and its reverse scan
// (1.4 step 3). Everything chunk-local (the UT transform, the decayed Grams, the parameter
// gradients given the states) is batched matmuls over all chunks at once in kernels/kda.cc; only
// the chain S_c -> S_{c+1} is inherently sequential, and these kernels run it with the state in
// shared memory, one thread block per (batch x head, 32 value columns): value columns of the
// state never mix, so a head's V columns split across blocks.
//
// Raw device pointers (no CUDA or libtorch headers here), contiguous and fp32 (W, kg, qg, states
// and dS bf16 where the tensor-core kernels' flags below say), BH = batch x value heads, N chunks
// of C tokens:
//   W, kg, qg (BH, N, C, K)   U, vt, o, dO, P, dvt (BH, N, C, V)   Aqk (BH, N, C, C)
//   eGC (BH, N, K)            states, dS (BH, N, K, V)             h0, hN, dSN, dS0 (BH, K, V)
// Supported: C in {32, 64}, K in {32, 64, 128}, V a multiple of 32, 16-byte aligned pointers
// (ScanSupported says). Each launcher returns the launch's cudaError_t as an int (0 = success).
// Each launcher runs the products on CUDA cores in fp32 (kda_scan.cu) or, with `tf32` set, on the
// tensor cores with TF32 operands and fp32 sums (kda_scan_tf32.cu: the state itself stays fp32,
// only its use as an operand is rounded). Only built with ODYSSEY_CUDA.
#pragma once

#include <cstdint>

namespace odyssey::kernels::cuda {

bool KdaScanSupported(int64_t C, int64_t K, int64_t V);

// Forward scan from h0 (null = zeros). Per chunk c with S the state before it:
//   vt_c = U_c - W_c S,  o_c = qg_c S + Aqk_c vt_c,  S <- eGC_c (.) S + kg_c^T vt_c.
// qg, Aqk and o may be null together (no output: the backward's recompute of the states); vt and
// states (S before each chunk) are written where not null. hN gets the final state.
// bf16_operands (the tensor-core kernel only): W, kg and qg hold bf16 values (their pointers point
// at the bf16 bits; the intra kernel wrote them rounded), read as the products' TF32 operands
// unchanged; U, Aqk, the state and every sum stay fp32. The per-chunk states (where written) are
// then written as bf16, for KdaChunkGrads. value_block: the value columns a block owns, 32, or 16
// with bf16_operands and an output at C = 64 and K >= 64 (twice the blocks, for grids that would
// not fill the multiprocessors).
struct KdaScanForwardArgs {
  const float *W, *U, *kg, *eGC, *qg, *Aqk, *h0;
  float *o, *vt, *states, *hN;
  int64_t BH, N, C, K, V;
  bool tf32 = false;
  bool bf16_operands = false;
  int value_block = 32;
  // The tensor-core kernel with an output: o_rows non-null writes o there instead of `o`, token t
  // of (batch x head) bh at o_rows + bh o_bh_stride + t V (elements), fp32 or bf16 (`o_rows_bf16`,
  // rounded to nearest even), for t < o_len only (the rows past it are the last chunk's padding).
  void* o_rows = nullptr;
  bool o_rows_bf16 = false;
  int64_t o_bh_stride = 0, o_len = 0;
};
// Whether KdaScanForward takes bf16_operands with this value_block for these sizes.
bool KdaScanBf16OperandsSupported(int64_t C, int64_t K, int64_t V, int value_block);
int KdaScanForward(const KdaScanForwardArgs& args, void* stream);

// Reverse scan from dSN (the gradient of the final state; null = zeros), chunks N-1 down to 0,
// with dS the gradient of the state after chunk c and P_c = Aqk_c^T dO_c:
//   dS_c = dS (written out),  dvt_c = P_c + kg_c dS,
//   dS <- eGC_c (.) dS + qg_c^T dO_c - W_c^T dvt_c.
// dS0 gets the gradient of h0. The fp32 kernel reads P; the tensor-core one (`tf32`) forms each
// P_c from Aqk and dO itself, an independent product beside the scan's chain, and reads Aqk
// instead (the other may be null).
// bf16_operands (the tensor-core kernel only): W, kg and qg hold bf16 values, as the forward's, and
// dS is written as bf16, for KdaChunkGrads.
struct KdaScanBackwardArgs {
  const float *W, *kg, *eGC, *qg, *dO, *P, *dSN;
  float *dvt, *dS, *dS0;
  int64_t BH, N, C, K, V;
  bool tf32 = false;
  const float* Aqk = nullptr;
  bool bf16_operands = false;
};
int KdaScanBackward(const KdaScanBackwardArgs& args, void* stream);

// The gradients of the chunk quantities given the states, on the tensor cores (TF32 operands,
// fp32 sums), per chunk c with h = states_c and dS = dS_c (the gradient of the state after c):
//   dqg_c = dO_c h^T,  dW_c = -dvt_c h^T,  dkg_c = vt_c dS^T,  dAqk_c = dO_c vt_c^T,
//   deGC_c = rowsum(h (.) dS)  (over V).
// Every product sums over V, which the scans split across blocks, so this is its own pass:
// one block per SM walks (batch x head, chunk) items, streaming each item's operands through
// shared memory in slices of 32 value columns, the next slice in flight while one is used.
// Shapes as above; outputs contiguous: dqg, dW, dkg (BH, N, C, K), dAqk (BH, N, C, C), deGC
// (BH, N, K). Sizes as KdaScanSupported.
// bf16: states and dS hold bf16 values (the bf16-operand scans wrote them), each its own TF32
// operand; deGC's products and sums stay fp32.
struct KdaChunkGradsArgs {
  const float *states, *dS, *dO, *vt, *dvt;
  float *dqg, *dW, *dkg, *dAqk, *deGC;
  int64_t BH, N, C, K, V;
  bool bf16 = false;
};
int KdaChunkGrads(const KdaChunkGradsArgs& args, void* stream);

// The tensor-core kernels behind `tf32` (arguments checked by the two above).
int KdaScanForwardTf32(const KdaScanForwardArgs& args, void* stream);
int KdaScanBackwardTf32(const KdaScanBackwardArgs& args, void* stream);

}  // namespace odyssey::kernels::cuda
