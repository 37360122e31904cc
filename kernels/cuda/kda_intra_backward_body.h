// The thread block of chunked KDA's intra-chunk backward (kernels/cuda/kda_intra_backward.h), as
// plain C++ that both compilers take: the CUDA kernel (kda_intra_backward.cu) runs
// KdaIntraBackwardPhase(p, ...) for p = 0 .. KdaIntraBackwardPhases(C) - 1 with a barrier after
// each, and kernels/kda.cc's host emulation runs every thread of a phase one after another on the
// CPU, so the CPU tests check this very code. The rule that makes the two agree: inside a phase
// a thread reads only what earlier phases wrote, or what it wrote itself; no two threads of a
// phase write the same element. (The emulation also runs the threads in reverse order, which
// any break of that rule would show.)
//
// Shared memory (floats), every matrix row-major with an odd leading dimension (column walks
// over rows are free of bank conflicts): five "big" slots of C x (max(K, V, C) + 1), then the
// tail: three "small" C x (C + 1) and the inverse's block-row scratch (16 x C), which the last
// phases reuse for dG and the column sums' partials; beta and dbeta of the chunk's rows.
// What the slots hold, phase by phase:
//   B0: kp -> Y -> dbeta's partial row sums -> kp again     B1: km (k itself in the sub-block form)
//   B2: dW -> R = dT T^T -> dA = lower(dAqk)                B3: dU -> dL = diag(beta) dA_kk
//   B4: X -> qp                                             S0: L_kk  S2: T
//   S1: A_kk -> dT -> the partial row sums of dA_kk L_kk (dbeta's Gram term)
//   the tail, from GradQK on: dG (C x (K + 1)), then the partial column sums of dkg kg
// Every element of dq, dk and dg is written once, by the thread or lane that owns it in GradQK
// (dq, dk; dG into the tail) or in the last phase (dg, the reverse cumulative sum of dG): what
// earlier phases contribute to it travels in that thread's registers (Carry: dX, whose tiles
// GradXY gives the same owners as GradQK's), not through global memory.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/kda_intra.h"
#include "kernels/cuda/kda_intra_backward.h"
#if defined(__CUDACC__)
#include "kernels/cuda/mma.cuh"
#endif

#if defined(__CUDACC__)
#define KDA_HD __host__ __device__ __forceinline__
#define KDA_UNROLL _Pragma("unroll")
#define KDA_NO_UNROLL _Pragma("unroll 1")
#else
#define KDA_HD inline
#define KDA_UNROLL
#define KDA_NO_UNROLL
#endif

namespace odyssey::kernels::cuda::kda_bwd {

constexpr int kB = 16;  // the inverse's block

// The widest matrix a big slot holds: C x K, C x V, or C x C (R, dA_kk, dA).
KDA_HD constexpr int64_t Widest(int64_t C, int64_t K, int64_t V) {
  return K > V ? (K > C ? K : C) : (V > C ? V : C);
}
// Row padding: odd strides for the CUDA-core products (4 x 4 tiles walk columns over rows), 4
// floats for the tensor-core ones (kTc: an mma fragment's 8 rows x 4 columns then fall in distinct
// banks when read by rows, at most 2 to a bank when read transposed; widths are multiples of 8).
KDA_HD constexpr int Pad(bool tc) { return tc ? 4 : 1; }
// Rows of the partial column sums of dkg kg the last phase adds: one a lane's two rows (tensor
// cores) or a thread's four.
KDA_HD constexpr int64_t PartRows(int64_t C, bool tc) { return tc ? C / 2 : C / 4; }
// The tail: the small slots and the inverse's scratch, or dG and the partials if wider.
KDA_HD constexpr int64_t TailFloats(int64_t C, int64_t K, bool tc) {
  const int64_t small = 3 * C * (C + Pad(tc)) + kB * C, late = C * (K + 1) + PartRows(C, tc) * K;
  return small > late ? small : late;
}
KDA_HD int64_t SmemFloats(int64_t C, int64_t K, int64_t V, bool tc = false) {
  return 5 * C * (Widest(C, K, V) + Pad(tc)) + TailFloats(C, K, tc) + 2 * C;
}
// Whether the tensor-core form takes these sizes: the whole-chunk Gram form with V a multiple of 8
// (every product's depth and width then a whole number of mma steps).
KDA_HD constexpr bool TensorCoreForm(bool sub_blocks, int64_t V) { return !sub_blocks && V % 8 == 0; }
// 0 beta; 1 factors; 2 Grams; 3 the inverse's diagonal blocks; two per later block row; then dT,
// dX and dY, R, dA_kk, dL, the products of dL and dA, the last.
// The phase after the leading ones (LeadingPhase: beta, factors, Grams, the inverse's diagonal
// blocks, two per later block row), where each block's own phases start.
KDA_HD constexpr int InverseRowPhaseEnd(int C) { return 4 + 2 * (C / kB - 1); }
KDA_HD constexpr int Phases(int C) { return InverseRowPhaseEnd(C) + 7; }
// The inverse's phases after its diagonal blocks (two a later block row): no work and no barrier
// where the block reads T instead (KdaIntraBackwardArgs::T).
KDA_HD constexpr bool InverseRowPhase(int C, int phase) { return phase >= 4 && phase < InverseRowPhaseEnd(C); }

// acc[x][y] += sum over m in [m0, m1) of a(i0 + x, m) b(m, j0 + y), with a(i, m) = a[i * ai + m * am]
// and b(m, j) = b[m * bm + j * bj] (strides pick a matrix or its transpose).
KDA_HD void TileProduct(float (&acc)[4][4], const float* a, int ai, int am, const float* b, int bm, int bj, int i0,
                        int j0, int m0, int m1) {
  for (int m = m0; m < m1; ++m) {
    float av[4], bv[4];
KDA_UNROLL
    for (int x = 0; x < 4; ++x) av[x] = a[(i0 + x) * ai + m * am];
KDA_UNROLL
    for (int y = 0; y < 4; ++y) bv[y] = b[m * bm + (j0 + y) * bj];
KDA_UNROLL
    for (int x = 0; x < 4; ++x) {
KDA_UNROLL
      for (int y = 0; y < 4; ++y) acc[x][y] = fmaf(av[x], bv[y], acc[x][y]);
    }
  }
}

// The sub-block form's products against k decayed to a reference row r: acc[x][y] += sum over m
// in [m0, m1) of a(i0 + x, m) k(m, j0 + y) exp(G[r] - G[m]) (kd false: k's rows are the
// reduction, m a row of k and j0 + y a channel) or a(i0 + x, m) k(j0 + y, m) exp(G[r] - G[j0 +
// y]) in channel m (kd true: m a channel, j0 + y a row of k). k row-major with leading
// dimension ldk, G (C, K) row-major with K columns.
template <bool kd>
KDA_HD void TileProductDecayed(float (&acc)[4][4], const float* a, int ai, int am, const float* k, int ldk,
                               const float* G, int Kc, int r, int i0, int j0, int m0, int m1) {
  for (int m = m0; m < m1; ++m) {
    float av[4], bv[4];
    KDA_UNROLL
    for (int x = 0; x < 4; ++x) av[x] = a[(i0 + x) * ai + m * am];
    KDA_UNROLL
    for (int y = 0; y < 4; ++y) {
      const int row = kd ? j0 + y : m, ch = kd ? m : j0 + y;
      bv[y] = k[row * ldk + ch] * expf(G[r * Kc + ch] - G[row * Kc + ch]);
    }
    KDA_UNROLL
    for (int x = 0; x < 4; ++x) {
      KDA_UNROLL
      for (int y = 0; y < 4; ++y) acc[x][y] = fmaf(av[x], bv[y], acc[x][y]);
    }
  }
}

// The tensor-core products: a warp owns a 16 x 8 tile of an mma.sync m16n8k8 (TF32 operands,
// fp32 sums); lane = 4 g + c holds its rows g and g + 8 and columns 2c and 2c + 1, element e at
// row FragRow(lane, e), column FragCol(lane, e).
KDA_HD int FragRow(int lane, int e) { return lane / 4 + 8 * (e / 2); }
KDA_HD int FragCol(int lane, int e) { return 2 * (lane % 4) + e % 2; }

// acc += sum over m in [m0, m1) (a multiple of 8 long) of a(i0 + row, m) b(m, j0 + col) for the
// lane's elements, a and b strided as TileProduct's. On the GPU the warp's lanes run it together
// (one mma per 8 of m, operands rounded to TF32); the CPU emulation runs each lane alone, in fp32,
// over the same shared-memory elements, so it checks the indexing, not the rounding.
// kARounded / kBRounded: that operand already holds Tf32Rounded values (the writer rounded each
// element once, instead of every fragment load rounding it again: two instructions an operand
// element, about half of a tile step's); its bits then go to the mma as they are. The sums are
// bit for bit those of rounding here. The intra kernel's slices, X and Y are stored so; this
// block's own operands are not: rounded where written (with ex2.approx exp) it issued 6% fewer
// instructions but ran 25% slower on an H100 (13.0 cycles between a warp's issues against 9.4,
// 5.6 of them waiting on L1TEX loads; a 4-byte spill in the kGivenT instance), twenty-seventh
// session, docs/benchmarks.md.
template <bool kARounded = false, bool kBRounded = false>
KDA_HD void WarpTile(float (&acc)[4], const float* a, int ai, int am, const float* b, int bm, int bj, int i0, int j0,
                     int m0, int m1, int lane) {
#if defined(__CUDA_ARCH__)
  const int g = lane / 4, c = lane % 4;
  const float* ar = a + (i0 + g) * ai;
  const float* bc = b + (j0 + g) * bj;
  auto op_a = [](float x) { return kARounded ? __float_as_uint(x) : mma::Tf32(x); };
  auto op_b = [](float x) { return kBRounded ? __float_as_uint(x) : mma::Tf32(x); };
  for (int m = m0; m < m1; m += 8) {
    const uint32_t af[4] = {op_a(ar[(m + c) * am]), op_a(ar[8 * ai + (m + c) * am]), op_a(ar[(m + c + 4) * am]),
                            op_a(ar[8 * ai + (m + c + 4) * am])};
    mma::MmaTf32(acc, af, op_b(bc[(m + c) * bm]), op_b(bc[(m + c + 4) * bm]));
  }
#else
  for (int e = 0; e < 4; ++e) {
    const int i = i0 + FragRow(lane, e), j = j0 + FragCol(lane, e);
    for (int m = m0; m < m1; ++m) acc[e] = fmaf(a[i * ai + m * am], b[m * bm + j * bj], acc[e]);
  }
#endif
}

// rows x cols floats from global src (rows of cols) into shared dst (row stride ld), by 16-byte
// pieces (cols, ld and both addresses multiples of 4 floats): on the GPU asynchronous (cp.async;
// each thread waits for its own with AsyncWait, before the barrier after which others read them),
// in the emulation a plain copy.
KDA_HD void AsyncRows(float* dst, int ld, const float* src, int rows, int cols, int tid, int nt) {
  const int per = cols / 4;
  for (int e = tid; e < rows * per; e += nt) {
    const int i = e / per, c = 4 * (e % per);
#if defined(__CUDA_ARCH__)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(mma::SmemAddr(dst + i * ld + c)),
                 "l"(src + static_cast<int64_t>(i) * cols + c));
#else
    for (int x = 0; x < 4; ++x) dst[i * ld + c + x] = src[static_cast<int64_t>(i) * cols + c + x];
#endif
  }
}
KDA_HD void AsyncWait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// T = (I + A)^-1 for A strictly lower (C x C, leading dimension ld), T in the same layout, by
// 16-row blocks: the diagonal blocks by forward substitution, a thread per column, and zeros
// above them (one phase); then each later block row against the columns before it in two
// phases, P = A_r,<r T_<r,<r (P: kB x C scratch), then T_r,<r = -T_rr P.
template <int C>
KDA_HD void InvertDiagonalBlocks(const float* A, float* T, int ld, int tid, int nt) {
  for (int c = tid; c < C; c += nt) {
    const int r0 = c / kB * kB;
    for (int i = r0; i < c; ++i) T[i * ld + c] = 0.f;
    T[c * ld + c] = 1.f;
    for (int i = c + 1; i < r0 + kB; ++i) {
      float s = 0.f;
      for (int j = c; j < i; ++j) s = fmaf(-A[i * ld + j], T[j * ld + c], s);
      T[i * ld + c] = s;
    }
  }
  for (int e = tid; e < C * C; e += nt) {
    const int i = e / C, j = e % C;
    if (j / kB > i / kB) T[i * ld + j] = 0.f;
  }
}
template <int C>
KDA_HD void InvertRowProduct(int r0, const float* A, const float* T, float* P, int ld, int tid, int nt) {
  for (int e = tid; e < kB * r0; e += nt) {
    const int i = e / r0, c = e % r0;
    float s = 0.f;
    for (int j = c; j < r0; ++j) s = fmaf(A[(r0 + i) * ld + j], T[j * ld + c], s);
    P[i * C + c] = s;
  }
}
template <int C>
KDA_HD void InvertRowSolve(int r0, float* T, const float* P, int ld, int tid, int nt) {
  for (int e = tid; e < kB * r0; e += nt) {
    const int i = e / r0, c = e % r0;
    float s = 0.f;
    for (int m = 0; m <= i; ++m) s = fmaf(-T[(r0 + i) * ld + r0 + m], P[m * C + c], s);
    T[(r0 + i) * ld + c] = s;
  }
}

// What a block of either kernel sees: its (batch x head, chunk), its inputs (Args: KdaIntraArgs or
// KdaIntraBackwardArgs, which share these fields) and its shared memory's slots.
// kIn16: q, k and v are bf16 (else fp32; kda_intra.h KdaQkvBf16).
template <int C, int K, class Args, bool kTc = false, bool kIn16 = false>
struct ChunkView {
  const Args& a;
  int V, ldK, ldV, ldC;
  int64_t chunk, t0, ck, cv, cc;
  const void *qb, *kb, *vb;  // the (batch, head)'s first element of q, k, v
  int64_t bo;                // and of beta
  int64_t b_, h_;            // the block's batch and value head
  const float* G;
  float *B0, *B1, *B2, *B3, *B4, *S0, *S1, *S2, *P, *sB, *sDb;

  KDA_HD ChunkView(const Args& args, float* sm, int64_t bh, int64_t n) : a(args) {
    V = static_cast<int>(a.V), ldK = K + Pad(kTc), ldV = V + Pad(kTc), ldC = C + Pad(kTc);
    const int64_t b = bh / a.HV, h = bh % a.HV;
    chunk = bh * a.N + n, t0 = n * C;
    ck = chunk * C * K, cv = chunk * C * V, cc = chunk * C * C;
    qb = Advance(a.q, b * a.q_sb + h * a.q_sh), kb = Advance(a.k, b * a.k_sb + h * a.k_sh);
    vb = Advance(a.v, b * a.v_sb + h * a.v_sh);
    bo = b * a.b_sb + h * a.b_sh;
    b_ = b, h_ = h;
    G = a.G + ck;
    const int64_t big = C * (Widest(C, K, V) + Pad(kTc)), small = C * (C + Pad(kTc));
    B0 = sm, B1 = B0 + big, B2 = B1 + big, B3 = B2 + big, B4 = B3 + big;
    S0 = B4 + big, S1 = S0 + small, S2 = S1 + small, P = S2 + small, sB = S0 + TailFloats(C, K, kTc), sDb = sB + C;
  }
  // x advanced by `elements` of q's, k's and v's dtype.
  KDA_HD static const void* Advance(const void* x, int64_t elements) {
    if constexpr (kIn16) {
      return static_cast<const uint16_t*>(x) + elements;
    } else {
      return static_cast<const float*>(x) + elements;
    }
  }
  // Row i of the chunk is token t0 + i; rows at or past L are padding (zeros). q, k, v are fp32
  // or bf16 (kIn16); q is scaled as read.
  KDA_HD float K_(int i, int d) const { return t0 + i < a.L ? KdaLoadAs<kIn16>(kb, (t0 + i) * a.k_st + d) : 0.f; }
  KDA_HD float Q_(int i, int d) const {
    return t0 + i < a.L ? KdaLoadAs<kIn16>(qb, (t0 + i) * a.q_st + d) * a.q_scale : 0.f;
  }
  KDA_HD float V_(int i, int d) const { return t0 + i < a.L ? KdaLoadAs<kIn16>(vb, (t0 + i) * a.v_st + d) : 0.f; }
  // Phase 0 of both: beta of the chunk's rows (0 past L).
  KDA_HD void LoadBeta(int tid, int nt) {
    for (int i = tid; i < C; i += nt) {
      sB[i] = t0 + i < a.L ? KdaLoad(a.beta, a.bf16 & kKdaBf16Beta, bo + (t0 + i) * a.b_st) : 0.f;
    }
  }
};

// The members of a ChunkView base, by name, in a block that derives from it.
#define KDA_CHUNK_VIEW(Base)                                                                   \
  using Base::a;                                                                               \
  using Base::V;                                                                               \
  using Base::ldK;                                                                             \
  using Base::ldV;                                                                             \
  using Base::ldC;                                                                             \
  using Base::chunk;                                                                           \
  using Base::t0;                                                                              \
  using Base::ck;                                                                              \
  using Base::cv;                                                                              \
  using Base::cc;                                                                              \
  using Base::G;                                                                               \
  using Base::b_;                                                                              \
  using Base::h_;                                                                              \
  using Base::K_;                                                                              \
  using Base::Q_;                                                                              \
  using Base::V_;                                                                              \
  using Base::B0;                                                                              \
  using Base::B1;                                                                              \
  using Base::B2;                                                                              \
  using Base::B3;                                                                              \
  using Base::B4;                                                                              \
  using Base::S0;                                                                              \
  using Base::S1;                                                                              \
  using Base::S2;                                                                              \
  using Base::P;                                                                               \
  using Base::sB;                                                                              \
  using Base::sDb;                                                                             \
  KDA_HD Block(const decltype(Base::a)& args, float* sm, int64_t bh, int64_t n) : Base(args, sm, bh, n) {}

// The phases both blocks share, in order: beta, the factors, the Grams, the inverse's diagonal
// blocks, two per later block row. False for a phase after them (the block's own).
template <int C, class Blk>
KDA_HD bool LeadingPhase(int phase, Blk& b, int tid, int nt) {
  if (phase == 0) {
    b.LoadBeta(tid, nt);
  } else if (phase == 1) {
    b.Factors(tid, nt);
  } else if (phase == 2) {
    b.Grams(tid, nt);
  } else if (phase == 3) {
    b.InverseDiagonal(tid, nt);
  } else if (phase < InverseRowPhaseEnd(C)) {
    if constexpr (Blk::InverseGiven()) return true;
    const int r0 = kB * (1 + (phase - 4) / 2);
    if ((phase - 4) % 2 == 0) {
      InvertRowProduct<C>(r0, b.S1, b.S2, b.P, b.ldC, tid, nt);
    } else {
      InvertRowSolve<C>(r0, b.S2, b.P, b.ldC, tid, nt);
    }
  } else {
    return false;
  }
  return true;
}

// Tile j of the n tiles a phase enumerates for warp (kTc) or thread `tid` of the block's
// kKdaIntraBackwardThreads: tiles go to warps (threads) round robin, so GradXY's tiles of dX and
// GradQK's tiles of C x K have the same owner lane by lane, which lets dX travel in registers.
template <bool kTc>
KDA_HD constexpr int TilesPerOwner(int n) {
  const int owners = kTc ? kKdaIntraBackwardThreads / 32 : kKdaIntraBackwardThreads;
  return (n + owners - 1) / owners;
}
template <bool kTc>
KDA_HD int OwnedTile(int tid, int j) {
  return kTc ? tid / 32 + j * (kKdaIntraBackwardThreads / 32) : tid + j * kKdaIntraBackwardThreads;
}
// What a thread carries from one phase to a later one: dX's elements of its C x K tiles (4 a
// lane's 16 x 8 tile, or a thread's 4 x 4), from GradXY to GradQK.
template <int C, int K, bool kTc>
struct Carry {
  static constexpr int kTiles = kTc ? TilesPerOwner<true>((C / 16) * (K / 8)) : TilesPerOwner<false>((C / 4) * (K / 4));
  using Tile = std::conditional_t<kTc, float[4], float[4][4]>;  // as the tile's products hold it
  Tile gx[kTiles];
};

// One block of the backward. kSub: the sub-block Gram form (kernels/kda.h kSubBlocks), every
// factor against the first row of its row's 16-row block instead of the chunk's first row, so no
// factor exceeds a block's decay. kTc: the products on the tensor cores (WarpTile, 16 x 8 tiles a
// warp, TF32 operands) instead of 4 x 4 register tiles a thread (fp32); the whole-chunk form only
// (TensorCoreForm). Every output element is written by the one lane or thread that owns it, in
// both.
// kGivenT: the block reads T (KdaIntraBackwardArgs::T) instead of inverting; the whole-chunk form
// only. A compile-time choice: checked at run time it cost the kernel registers (and spills).
template <int C, int K, bool kSub, bool kTc = false, bool kIn16 = false, bool kGivenT = false>
struct Block : ChunkView<C, K, KdaIntraBackwardArgs, kTc, kIn16> {
  static_assert(!(kSub && kTc), "the tensor-core products take the whole-chunk form only");
  static_assert(!(kSub && kGivenT), "a given T is the whole-chunk form's");
  using Base = ChunkView<C, K, KdaIntraBackwardArgs, kTc, kIn16>;
  KDA_CHUNK_VIEW(Base)

  // The reference row of row i's factors.
  KDA_HD static int Ref(int i) { return kSub ? i / kB * kB : 0; }
  // Whether the block reads T (the forward kernel's) instead of inverting.
  KDA_HD static constexpr bool InverseGiven() { return kGivenT; }
  // Columns a partial row sum of dbeta covers in GradXY: a 4 x 4 tile's, or a lane's two.
  static constexpr int kPer = kTc ? 2 : 4;
  // Whether row i of the chunk is a token (rows past L are padding: no gradient leaves for them),
  // and element (i, d) of an input gradient o.
  KDA_HD bool Token(int i) const { return t0 + i < a.L; }
  KDA_HD int64_t At(const KdaGradOut& o, int i, int d) const { return b_ * o.sb + h_ * o.sh + (t0 + i) * o.st + d; }

  // 1: the factors the products read.
  // The element-wise loops run a thread's elements in one loop the compiler unrolls whole (nt is
  // the constant kKdaIntraBackwardThreads in the kernel), so their loads are in flight together;
  // grouping them by hand into fours measured slower (docs/benchmarks.md, nineteenth session).
  // The tensor-core form's rows (ldK, ldV multiples of 4) take dW and dU by asynchronous copies
  // that land while the factors and the inverse compute (InverseDiagonal waits for them; GradT
  // reads them first); the CUDA-core form's odd strides take them element by element.
  KDA_HD void Factors(int tid, int nt) {
    if constexpr (kTc) {
      AsyncRows(B2, ldK, a.dW + ck, C, K, tid, nt);
      AsyncRows(B3, ldV, a.dU + cv, C, V, tid, nt);
      if constexpr (kGivenT) AsyncRows(S2, ldC, a.T + cc, C, C, tid, nt);
    } else if constexpr (kGivenT) {
      for (int e = tid; e < C * C; e += nt) S2[(e / C) * ldC + e % C] = a.T[cc + e];
    }
    for (int e = tid; e < C * K; e += nt) {
      const int i = e / K, d = e % K;
      const float kk = K_(i, d), gi = G[e], gr = G[Ref(i) * K + d];
      B0[i * ldK + d] = kk * expf(gi - gr);
      // kSub: k itself, decayed per block row on the fly; else km = k Em (the reference row is 0).
      B1[i * ldK + d] = kSub ? kk : kk * expf(gr - gi);
      if (!kTc) B2[i * ldK + d] = a.dW[ck + e];
      B4[i * ldK + d] = sB[i] * kk * expf(gi);
    }
    if (!kTc) {
      for (int e = tid; e < C * V; e += nt) B3[(e / V) * ldV + e % V] = a.dU[cv + e];
    }
  }
  // 2: L_kk = strict_lower(kp km^T) and A_kk = diag(beta) L_kk.
  KDA_HD void GramOut(int i, int j, float acc) {
    const float l = j < i ? acc : 0.f;
    S0[i * ldC + j] = l;
    S1[i * ldC + j] = l * sB[i];
  }
  KDA_HD void Grams(int tid, int nt) {
    if constexpr (kTc) {
      const int lane = tid % 32;
      for (int tile = tid / 32; tile < (C / 16) * (C / 8); tile += nt / 32) {
        const int i0 = 16 * (tile / (C / 8)), j0 = 8 * (tile % (C / 8));
        float acc[4] = {};
        if (j0 < i0 + 16) WarpTile(acc, B0, ldK, 1, B1, 1, ldK, i0, j0, 0, K, lane);
        for (int e = 0; e < 4; ++e) GramOut(i0 + FragRow(lane, e), j0 + FragCol(lane, e), acc[e]);
      }
      return;
    }
    constexpr int kTiles = (C / 4) * (C / 4);
    for (int tile = tid; tile < kTiles; tile += nt) {
      const int i0 = 4 * (tile / (C / 4)), j0 = 4 * (tile % (C / 4));
      float acc[4][4] = {};
      if (j0 <= i0) {
        if (kSub) {
          TileProductDecayed<true>(acc, B0, ldK, 1, B1, ldK, G, K, Ref(i0), i0, j0, 0, K);
        } else {
          TileProduct(acc, B0, ldK, 1, B1, 1, ldK, i0, j0, 0, K);
        }
      }
      for (int x = 0; x < 4; ++x) {
        for (int y = 0; y < 4; ++y) GramOut(i0 + x, j0 + y, acc[x][y]);
      }
    }
  }
  // 3: Y = diag(beta) v (kp's slot: the Grams are done); T's diagonal blocks by forward
  // substitution, a thread per column, and zeros above them.
  KDA_HD void InverseDiagonal(int tid, int nt) {
    for (int e = tid; e < C * V; e += nt) {
      const int i = e / V, d = e % V;
      B0[i * ldV + d] = sB[i] * V_(i, d);
    }
    if constexpr (!kGivenT) InvertDiagonalBlocks<C>(S1, S2, ldC, tid, nt);
    if constexpr (kTc) AsyncWait();  // dW, dU (and T) (Factors) in place before this phase's barrier
  }
  // dT = dW X^T + dU Y^T (A_kk's slot: T is complete).
  KDA_HD void GradT(int tid, int nt) {
    if constexpr (kTc) {
      const int lane = tid % 32;
      for (int tile = tid / 32; tile < (C / 16) * (C / 8); tile += nt / 32) {
        const int i0 = 16 * (tile / (C / 8)), j0 = 8 * (tile % (C / 8));
        float acc[4] = {};
        WarpTile(acc, B2, ldK, 1, B4, 1, ldK, i0, j0, 0, K, lane);
        WarpTile(acc, B3, ldV, 1, B0, 1, ldV, i0, j0, 0, V, lane);
        for (int e = 0; e < 4; ++e) S1[(i0 + FragRow(lane, e)) * ldC + j0 + FragCol(lane, e)] = acc[e];
      }
      return;
    }
    constexpr int kTiles = (C / 4) * (C / 4);
    for (int tile = tid; tile < kTiles; tile += nt) {
      const int i0 = 4 * (tile / (C / 4)), j0 = 4 * (tile % (C / 4));
      float acc[4][4] = {};
      TileProduct(acc, B2, ldK, 1, B4, 1, ldK, i0, j0, 0, K);
      TileProduct(acc, B3, ldV, 1, B0, 1, ldV, i0, j0, 0, V);
      for (int x = 0; x < 4; ++x) {
        for (int y = 0; y < 4; ++y) S1[(i0 + x) * ldC + j0 + y] = acc[x][y];
      }
    }
  }
  // dX = T^T dW and dY = T^T dU by tiles (T lower: rows m >= i): dX kept in the owner's carry
  // for GradQK (its terms of dk and dG), dY's term of dv written, and each tile's rows' partial
  // sums of dbeta into B0 (Y's slot: dT is done): [C][K / kPer] for dX, then [C][V / kPer] for dY.
  // Element (i, d) of dX (is_x) or dY, g its value, in = k and G there (dX) or v (dY), loaded
  // by XYLoad before the product: dv for dY; returns its term of dbeta's row sum.
  struct XYIn {
    float kv, gi;
  };
  KDA_HD XYIn XYLoad(bool is_x, int i, int d) const {
    if (is_x) return {K_(i, d), G[i * K + d]};
    return {V_(i, d), 0.f};
  }
  KDA_HD float XYOut(bool is_x, int i, int d, float g, XYIn in) {
    if (is_x) return g * (in.kv * expf(in.gi));
    if (Token(i)) KdaStoreAs<kIn16>(a.dv.p, At(a.dv, i, d), g * sB[i]);
    return g * in.kv;
  }
  // One tile of dX (is_x: T^T dW) or dY (T^T dU) into acc, its inputs loaded before the product,
  // dv written for dY, its rows' partial sums of dbeta into B0's [C][cols / kPer] of dX or dY. A
  // lane's 16 x 8 tile (tensor cores) from row i0, column d0:
  KDA_HD void XYTile(bool is_x, int i0, int d0, int lane, float (&acc)[4]) {
    const int cols = is_x ? K : V;
    float* part = is_x ? B0 : B0 + C * (K / kPer);
    XYIn in[4];
    for (int e = 0; e < 4; ++e) in[e] = XYLoad(is_x, i0 + FragRow(lane, e), d0 + FragCol(lane, e));
    for (int e = 0; e < 4; ++e) acc[e] = 0.f;
    WarpTile(acc, S2, 1, ldC, is_x ? B2 : B3, is_x ? ldK : ldV, 1, i0, d0, i0, C, lane);
    for (int h = 0; h < 2; ++h) {  // the lane's rows g and g + 8, two columns each
      const int i = i0 + FragRow(lane, 2 * h);
      float row = 0.f;
      for (int e = 2 * h; e < 2 * h + 2; ++e) row += XYOut(is_x, i, d0 + FragCol(lane, e), acc[e], in[e]);
      part[i * (cols / kPer) + (d0 + FragCol(lane, 2 * h)) / kPer] = row;
    }
  }
  // or a thread's 4 x 4 (CUDA cores).
  KDA_HD void XYTile(bool is_x, int i0, int d0, float (&acc)[4][4]) {
    const int cols = is_x ? K : V;
    float* part = is_x ? B0 : B0 + C * (K / kPer);
    TileProduct(acc, S2, 1, ldC, is_x ? B2 : B3, is_x ? ldK : ldV, 1, i0, d0, i0, C);
    KDA_UNROLL
    for (int x = 0; x < 4; ++x) {
      float row = 0.f;
      KDA_UNROLL
      for (int y = 0; y < 4; ++y) row += XYOut(is_x, i0 + x, d0 + y, acc[x][y], XYLoad(is_x, i0 + x, d0 + y));
      part[(i0 + x) * (cols / kPer) + d0 / kPer] = row;
    }
  }
  KDA_HD void GradXY(int tid, int nt, Carry<C, K, kTc>& carry) {
    if constexpr (kTc) {
      const int lane = tid % 32;
      constexpr int xt = (C / 16) * (K / 8);
      const int yt = (C / 16) * (V / 8);
      // dX's tiles first, each the j-th of its warp (GradQK's numbering), into the carry; then dY's.
      KDA_NO_UNROLL
      for (int j = 0; j < Carry<C, K, kTc>::kTiles; ++j) {
        const int t = OwnedTile<true>(tid, j);
        if (t >= xt) break;
        XYTile(true, 16 * (t / (K / 8)), 8 * (t % (K / 8)), lane, carry.gx[j]);
      }
      for (int t = tid / 32; t < yt; t += nt / 32) {
        float acc[4];
        XYTile(false, 16 * (t / (V / 8)), 8 * (t % (V / 8)), lane, acc);
      }
    } else {
      constexpr int xt = (C / 4) * (K / 4);
      const int yt = (C / 4) * (V / 4);
      KDA_NO_UNROLL
      for (int j = 0; j < Carry<C, K, kTc>::kTiles; ++j) {
        const int t = OwnedTile<false>(tid, j);
        if (t >= xt) break;
        float(&acc)[4][4] = carry.gx[j];
        for (int x = 0; x < 4; ++x) {
          for (int y = 0; y < 4; ++y) acc[x][y] = 0.f;
        }
        XYTile(true, 4 * (t / (K / 4)), 4 * (t % (K / 4)), acc);
      }
      for (int t = tid; t < yt; t += nt) {
        float acc[4][4] = {};
        XYTile(false, 4 * (t / (V / 4)), 4 * (t % (V / 4)), acc);
      }
    }
  }
  // dbeta's dX and dY terms summed (a thread per row); R = dT T^T into B2 (dW's slot), T lower:
  // columns m <= j.
  KDA_HD void GradR(int tid, int nt) {
    for (int i = tid; i < C; i += nt) {
      float s[4] = {};  // four chains of adds, not one
      for (int c = 0; c < K / kPer; ++c) s[c % 4] += B0[i * (K / kPer) + c];
      for (int c = 0; c < V / kPer; ++c) s[c % 4] += B0[C * (K / kPer) + i * (V / kPer) + c];
      sDb[i] = (s[0] + s[1]) + (s[2] + s[3]);
    }
    if constexpr (kTc) {
      const int lane = tid % 32;
      for (int tile = tid / 32; tile < (C / 16) * (C / 8); tile += nt / 32) {
        const int i0 = 16 * (tile / (C / 8)), j0 = 8 * (tile % (C / 8));
        float acc[4] = {};
        WarpTile(acc, S1, ldC, 1, S2, 1, ldC, i0, j0, 0, j0 + 8, lane);
        for (int e = 0; e < 4; ++e) B2[(i0 + FragRow(lane, e)) * ldC + j0 + FragCol(lane, e)] = acc[e];
      }
      return;
    }
    constexpr int kTiles = (C / 4) * (C / 4);
    for (int tile = tid; tile < kTiles; tile += nt) {
      const int i0 = 4 * (tile / (C / 4)), j0 = 4 * (tile % (C / 4));
      float acc[4][4] = {};
      TileProduct(acc, S1, ldC, 1, S2, 1, ldC, i0, j0, 0, j0 + 4);
      for (int x = 0; x < 4; ++x) {
        for (int y = 0; y < 4; ++y) B2[(i0 + x) * ldC + j0 + y] = acc[x][y];
      }
    }
  }
  // dA_kk = strict_lower(-T^T R), T lower: rows m >= i. Written as dL = diag(beta) dA_kk into B3
  // (dU's slot), and each owner's partial row sums of dA_kk L_kk (dbeta's Gram term) into S1
  // (dT's slot: R is done), [C][Slots()]: a lane's two columns or a thread's four.
  KDA_HD static constexpr int Slots() { return kTc ? C / 2 : C / 4; }
  KDA_HD void GradAkk(int tid, int nt) {
    if constexpr (kTc) {
      const int lane = tid % 32;
      for (int tile = tid / 32; tile < (C / 16) * (C / 8); tile += nt / 32) {
        const int i0 = 16 * (tile / (C / 8)), j0 = 8 * (tile % (C / 8));
        float acc[4] = {};
        if (j0 < i0 + 16) WarpTile(acc, S2, 1, ldC, B2, ldC, 1, i0, j0, i0, C, lane);
        float part[2] = {};
        for (int e = 0; e < 4; ++e) {
          const int i = i0 + FragRow(lane, e), j = j0 + FragCol(lane, e);
          const float da = j < i ? -acc[e] : 0.f;
          B3[i * ldC + j] = da * sB[i];
          part[e / 2] = fmaf(da, S0[i * ldC + j], part[e / 2]);
        }
        for (int h = 0; h < 2; ++h) S1[(i0 + FragRow(lane, 2 * h)) * ldC + j0 / 2 + lane % 4] = part[h];
      }
    } else {
      constexpr int kTiles = (C / 4) * (C / 4);
      for (int tile = tid; tile < kTiles; tile += nt) {
        const int i0 = 4 * (tile / (C / 4)), j0 = 4 * (tile % (C / 4));
        float acc[4][4] = {};
        if (j0 <= i0) TileProduct(acc, S2, 1, ldC, B2, ldC, 1, i0, j0, i0, C);
        for (int x = 0; x < 4; ++x) {
          const int i = i0 + x;
          float part = 0.f;
          for (int y = 0; y < 4; ++y) {
            const int j = j0 + y;
            const float da = j < i ? -acc[x][y] : 0.f;
            B3[i * ldC + j] = da * sB[i];
            part = fmaf(da, S0[i * ldC + j], part);
          }
          S1[i * ldC + j0 / 4] = part;
        }
      }
    }
  }
  // dbeta += rowsum(dA_kk L_kk) from GradAkk's partials (a thread per row); kp, qp (B0, B4) and
  // dA = lower(dAqk) (B2: R is done) for the last products.
  KDA_HD void GradL(int tid, int nt) {
    for (int i = tid; i < C; i += nt) {
      float s[4] = {};
      for (int c = 0; c < Slots(); ++c) s[c % 4] += S1[i * ldC + c];
      sDb[i] += (s[0] + s[1]) + (s[2] + s[3]);
    }
    for (int e = tid; e < C * K; e += nt) {
      const int i = e / K, d = e % K;
      const float ep = expf(G[e] - G[Ref(i) * K + d]);
      B0[i * ldK + d] = K_(i, d) * ep;
      B4[i * ldK + d] = Q_(i, d) * ep;
    }
    for (int e = tid; e < C * C; e += nt) {
      const int i = e / C, j = e % C;
      B2[i * ldC + j] = j <= i ? a.dAqk[cc + e] : 0.f;
    }
  }
  // By tiles of rows r and columns d: dkp = dL km (dL strict lower: columns j < r), dqp = dA km
  // (j <= r), dkm = dL^T kp + dA^T qp (rows i >= r). The tile's owner then has every term of its
  // elements (dX from its carry) and writes dq, dk, dG (into the tail) and the partial column
  // sums of dkg kg. Element (r, d), its inputs loaded by QKLoad before the products: returns its
  // dkg kg.
  struct QKIn {
    float dqg, dkg, kk, qq, gi, gr, gc;  // G at the element, its reference row and the chunk's last row
  };
  KDA_HD QKIn QKLoad(int r, int d) const {
    const int64_t o = ck + static_cast<int64_t>(r) * K + d;
    return {a.dqg[o], a.dkg[o], K_(r, d), Q_(r, d), G[r * K + d], G[Ref(r) * K + d], G[(C - 1) * K + d]};
  }
  KDA_HD float QKOut(int r, int d, float dkp, float dqp, float dkm, float gx, const QKIn& in) {
    const float ep = expf(in.gi - in.gr), eg = expf(in.gi), ec = expf(in.gc - in.gi), kk = in.kk, qq = in.qq;
    const float dqg = in.dqg, dkg = in.dkg;
    if (Token(r)) KdaStoreAs<kIn16>(a.dq.p, At(a.dq, r, d), (dqg * eg + dqp * ep) * a.dq_scale);
    // Whole-chunk form: dkm is the gradient of km = k Em (Em against row 0, the reference row), so
    // dk gains dkm Em, dG loses dkm km. kSub: dkm is already the gradient of k (the factor folded
    // in), and dG loses dkm k.
    const float em = kSub ? 1.f : expf(in.gr - in.gi);
    const float xk = gx * sB[r] * eg;  // dX's term of dk (X = diag(beta) k eG)
    if (Token(r)) KdaStoreAs<kIn16>(a.dk.p, At(a.dk, r, d), dkg * ec + xk + dkp * ep + dkm * em);
    const float kg = dkg * (kk * ec);
    Tail()[r * (K + 1) + d] = dqg * (qq * eg) - kg + xk * kk + dqp * (qq * ep) + dkp * (kk * ep) - dkm * (kk * em);
    return kg;
  }
  // The tail's dG (C x (K + 1)) and, after it, the partial column sums (PartRows(C, kTc) x K).
  KDA_HD float* Tail() const { return S0; }
  KDA_HD float* Parts() const { return S0 + C * (K + 1); }
  KDA_HD void GradQK(int tid, int nt, const Carry<C, K, kTc>& carry) {
    (void)nt;
    if constexpr (kTc) {
      const int lane = tid % 32;
      constexpr int tiles = (C / 16) * (K / 8);
      KDA_NO_UNROLL
      for (int j = 0; j < Carry<C, K, kTc>::kTiles; ++j) {
        const int tile = OwnedTile<true>(tid, j);
        if (tile >= tiles) break;
        const int r0 = 16 * (tile / (K / 8)), d0 = 8 * (tile % (K / 8));
        QKIn in[4];  // in flight while the products run
        for (int e = 0; e < 4; ++e) in[e] = QKLoad(r0 + FragRow(lane, e), d0 + FragCol(lane, e));
        float dkp[4] = {}, dqp[4] = {}, dkm[4] = {}, kg[4];
        WarpTile(dkp, B3, ldC, 1, B1, ldK, 1, r0, d0, 0, r0 + 16, lane);
        WarpTile(dqp, B2, ldC, 1, B1, ldK, 1, r0, d0, 0, r0 + 16, lane);
        WarpTile(dkm, B3, 1, ldC, B0, ldK, 1, r0, d0, r0, C, lane);
        WarpTile(dkm, B2, 1, ldC, B4, ldK, 1, r0, d0, r0, C, lane);
        for (int e = 0; e < 4; ++e) {
          kg[e] = QKOut(r0 + FragRow(lane, e), d0 + FragCol(lane, e), dkp[e], dqp[e], dkm[e], carry.gx[j][e], in[e]);
        }
        // The lane's rows g and g + 8 summed per column: partial row r0 / 2 + g.
        for (int e = 0; e < 2; ++e) Parts()[(r0 / 2 + FragRow(lane, 0)) * K + d0 + FragCol(lane, e)] = kg[e] + kg[e + 2];
      }
    } else {
      constexpr int tiles = (C / 4) * (K / 4);
      KDA_NO_UNROLL
      for (int j = 0; j < Carry<C, K, kTc>::kTiles; ++j) {
        const int tile = OwnedTile<false>(tid, j);
        if (tile >= tiles) break;
        const int r0 = 4 * (tile / (K / 4)), d0 = 4 * (tile % (K / 4));
        float dkp[4][4] = {}, dqp[4][4] = {}, dkm[4][4] = {};
        if (kSub) {
          // The keys decayed to the tile's block row; dkm per block row b of the rows i >= r that
          // read r's key, each decayed to that block's reference row: dkm here is already the
          // gradient of k_r (the factor folded in).
          TileProductDecayed<false>(dkp, B3, ldC, 1, B1, ldK, G, K, Ref(r0), r0, d0, 0, r0 + 4);
          TileProductDecayed<false>(dqp, B2, ldC, 1, B1, ldK, G, K, Ref(r0), r0, d0, 0, r0 + 4);
          for (int rb = Ref(r0); rb < C; rb += kB) {
            float part[4][4] = {};
            TileProduct(part, B3, 1, ldC, B0, ldK, 1, r0, d0, rb > r0 ? rb : r0, rb + kB);
            TileProduct(part, B2, 1, ldC, B4, ldK, 1, r0, d0, rb > r0 ? rb : r0, rb + kB);
            for (int x = 0; x < 4; ++x) {
              for (int y = 0; y < 4; ++y) {
                const int r = r0 + x, d = d0 + y;
                dkm[x][y] = fmaf(part[x][y], expf(G[rb * K + d] - G[r * K + d]), dkm[x][y]);
              }
            }
          }
        } else {
          TileProduct(dkp, B3, ldC, 1, B1, ldK, 1, r0, d0, 0, r0 + 4);
          TileProduct(dqp, B2, ldC, 1, B1, ldK, 1, r0, d0, 0, r0 + 4);
          TileProduct(dkm, B3, 1, ldC, B0, ldK, 1, r0, d0, r0, C);
          TileProduct(dkm, B2, 1, ldC, B4, ldK, 1, r0, d0, r0, C);
        }
        float col[4] = {};
        KDA_UNROLL
        for (int x = 0; x < 4; ++x) {
          KDA_UNROLL
          for (int y = 0; y < 4; ++y) {
            col[y] += QKOut(r0 + x, d0 + y, dkp[x][y], dqp[x][y], dkm[x][y], carry.gx[j][x][y],
                            QKLoad(r0 + x, d0 + y));
          }
        }
        for (int y = 0; y < 4; ++y) Parts()[(r0 / 4) * K + d0 + y] = col[y];
      }
    }
  }
  // dg = the reverse cumulative sum of dG down each column, from the last row's terms: the sum of
  // dkg kg over the chunk (the partials) and deGC eGC; dbeta out. Each column's rows are cut into
  // kSegs segments of kB rows, a thread each: it adds the rows below its segment itself (no
  // thread reads another's sums within the phase), then writes its own rows' dg, so a column's
  // stores run kSegs at a time where one thread a column wrote all C.
  static constexpr int kSegs = C / kB;
  KDA_HD void Last(int tid, int nt) {
    constexpr int kParts = static_cast<int>(PartRows(C, kTc));
    for (int w = tid; w < K * kSegs; w += nt) {
      const int d = w % K, i0 = w / K * kB;
      float s = a.deGC[chunk * K + d] * expf(G[(C - 1) * K + d]);
      for (int p = 0; p < kParts; ++p) s += Parts()[p * K + d];
      for (int i = C - 1; i >= i0 + kB; --i) s += Tail()[i * (K + 1) + d];
      for (int i = i0 + kB - 1; i >= i0; --i) {
        s += Tail()[i * (K + 1) + d];
        if (Token(i)) KdaStore(a.dg.p, a.dg.bf16, At(a.dg, i, d), s);
      }
    }
    for (int i = tid; i < C; i += nt) {
      if (Token(i)) KdaStore(a.dbeta.p, a.dbeta.bf16, At(a.dbeta, i, 0), sDb[i]);
    }
  }
};

// Phase `phase` of thread `tid` (of `nt`, which must be kKdaIntraBackwardThreads) of the block
// of (bh, chunk n); `carry` the thread's own, kept from one phase to the next.
template <int C, int K, bool kSub, bool kTc = false, bool kIn16 = false, bool kGivenT = false>
KDA_HD void KdaIntraBackwardPhase(int phase, const KdaIntraBackwardArgs& a, float* sm, int64_t bh, int64_t n, int tid,
                                  int nt, Carry<C, K, kTc>& carry) {
  Block<C, K, kSub, kTc, kIn16, kGivenT> b(a, sm, bh, n);
  if (!LeadingPhase<C>(phase, b, tid, nt)) {
    switch (phase - InverseRowPhaseEnd(C)) {
      case 0: b.GradT(tid, nt); break;
      case 1: b.GradXY(tid, nt, carry); break;
      case 2: b.GradR(tid, nt); break;
      case 3: b.GradAkk(tid, nt); break;
      case 4: b.GradL(tid, nt); break;
      case 5: b.GradQK(tid, nt, carry); break;
      default: b.Last(tid, nt); break;
    }
  }
}

// The chunk-local quantities of the sub-block Gram form (the forward of kernels/cuda/
// kda_intra.h's KdaIntraForward, which takes the whole-chunk form): qg, kg, W, U, Aqk and eGC
// from q, k, v, beta and G, every Gram factor against its row's 16-row block's first row.
// Shared memory as the backward's block: B0 kp, B1 k, B2 qp, B3 X, B4 Y, S1 A_kk, S2 T (S0 and
// dbeta's slot unused).
namespace sub_forward {

KDA_HD constexpr int Phases(int C) { return InverseRowPhaseEnd(C) + 1; }

template <int C, int K, bool kIn16 = false>
struct Block : ChunkView<C, K, KdaIntraArgs, false, kIn16> {
  using Base = ChunkView<C, K, KdaIntraArgs, false, kIn16>;
  KDA_CHUNK_VIEW(Base)

  KDA_HD static int Ref(int i) { return i / kB * kB; }
  KDA_HD static constexpr bool InverseGiven() { return false; }  // it computes T

  KDA_HD void Factors(int tid, int nt) {
    for (int e = tid; e < C * K; e += nt) {
      const int i = e / K, d = e % K;
      const float kk = K_(i, d), qq = Q_(i, d), g = G[i * K + d];
      const float ep = expf(g - G[Ref(i) * K + d]), eg = expf(g), gc = G[(C - 1) * K + d];
      B0[i * ldK + d] = kk * ep;
      B1[i * ldK + d] = kk;
      B2[i * ldK + d] = qq * ep;
      B3[i * ldK + d] = sB[i] * kk * eg;
      a.qg[ck + e] = qq * eg;
      a.kg[ck + e] = kk * expf(gc - g);
      if (i == 0) a.eGC[chunk * K + d] = expf(gc);
    }
    for (int e = tid; e < C * V; e += nt) {
      const int i = e / V, d = e % V;
      B4[i * ldV + d] = sB[i] * V_(i, d);
    }
  }
  // A_kk = diag(beta) strict_lower(L_kk) into S1, Aqk = lower(qp km) out, the keys decayed to
  // the tile's block row on the fly.
  KDA_HD void Grams(int tid, int nt) {
    constexpr int kTiles = (C / 4) * (C / 4);
    for (int tile = tid; tile < kTiles; tile += nt) {
      const int i0 = 4 * (tile / (C / 4)), j0 = 4 * (tile % (C / 4));
      float lk[4][4] = {}, qk[4][4] = {};
      if (j0 <= i0) {
        TileProductDecayed<true>(lk, B0, ldK, 1, B1, ldK, G, K, Ref(i0), i0, j0, 0, K);
        TileProductDecayed<true>(qk, B2, ldK, 1, B1, ldK, G, K, Ref(i0), i0, j0, 0, K);
      }
      for (int x = 0; x < 4; ++x) {
        for (int y = 0; y < 4; ++y) {
          const int i = i0 + x, j = j0 + y;
          S1[i * ldC + j] = j < i ? lk[x][y] * sB[i] : 0.f;
          a.Aqk[cc + static_cast<int64_t>(i) * C + j] = j <= i ? qk[x][y] : 0.f;
        }
      }
    }
  }
  KDA_HD void InverseDiagonal(int tid, int nt) { InvertDiagonalBlocks<C>(S1, S2, ldC, tid, nt); }
  // W = T X, U = T Y (T lower: columns m <= i).
  KDA_HD void Products(int tid, int nt) {
    const int xt = (C / 4) * (K / 4), yt = (C / 4) * (V / 4);
    for (int tile = tid; tile < xt + yt; tile += nt) {
      const bool is_x = tile < xt;
      const int cols = is_x ? K : V, t = is_x ? tile : tile - xt;
      const int i0 = 4 * (t / (cols / 4)), d0 = 4 * (t % (cols / 4));
      float acc[4][4] = {};
      TileProduct(acc, S2, ldC, 1, is_x ? B3 : B4, is_x ? ldK : ldV, 1, i0, d0, 0, i0 + 4);
      float* out = is_x ? a.W + ck : a.U + cv;
      for (int x = 0; x < 4; ++x) {
        for (int y = 0; y < 4; ++y) out[static_cast<int64_t>(i0 + x) * cols + d0 + y] = acc[x][y];
      }
    }
  }
};

template <int C, int K, bool kIn16 = false>
KDA_HD void Phase(int phase, const KdaIntraArgs& a, float* sm, int64_t bh, int64_t n, int tid, int nt) {
  Block<C, K, kIn16> b(a, sm, bh, n);
  if (!LeadingPhase<C>(phase, b, tid, nt)) b.Products(tid, nt);
}

}  // namespace sub_forward

#undef KDA_CHUNK_VIEW

}  // namespace odyssey::kernels::cuda::kda_bwd
