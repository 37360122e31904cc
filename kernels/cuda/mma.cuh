// Tensor-core building blocks shared by the .cu files of kernels/cuda (device code only): shared
// memory addresses, ldmatrix, mma.sync m16n8k16 bf16 -> fp32 (and m16n8k8 TF32 -> fp32), cp.async
// and the fragment loads.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16), lane = 4 g + c:
//   A (16 x 16, row-major): a0 = A[g][2c, 2c+1], a1 = A[g+8][2c, 2c+1], a2 = A[g][2c+8, 2c+9],
//     a3 = A[g+8][2c+8, 2c+9];
//   B (16 x 8): b0 = B[2c, 2c+1][g], b1 = B[2c+8, 2c+9][g];
//   C (16 x 8, fp32): c0, c1 = C[g][2c, 2c+1], c2, c3 = C[g+8][2c, 2c+1].
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace odyssey::kernels::cuda::mma {

using bf16 = __nv_bfloat16;

constexpr unsigned kFull = 0xffffffffu;  // every lane of a warp
// Elements of padding per shared-memory row of a gathered tile (stride C + 8): the eight row
// addresses of an ldmatrix then fall in distinct banks.
constexpr int kPad = 8;

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void LdMatrix4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ __forceinline__ void LdMatrix4T(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// x rounded to TF32 (10 mantissa bits, to nearest) for the .tf32 mma below.
__device__ __forceinline__ uint32_t Tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
// x rounded as Tf32 does, kept as a float: what a shared-memory operand holds when its writer rounds
// each element once (kda_bwd::WarpTile's kARounded / kBRounded) instead of every fragment load.
__device__ __forceinline__ float Tf32Rounded(float x) { return __uint_as_float(Tf32(x)); }
// d += a b, mma.sync m16n8k8 with TF32 operands (from Tf32) and fp32 sums. Fragments (lane =
// 4 g + c): a0 (g, c), a1 (g + 8, c), a2 (g, c + 4), a3 (g + 8, c + 4); b0 (c, g), b1 (c + 4, g);
// the accumulator as m16n8k16's.
__device__ __forceinline__ void MmaTf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 16 bytes global -> shared, asynchronous; zeros when !valid (src is then not read).
__device__ __forceinline__ void CpAsync16(bf16* dst, const bf16* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.commit_group;\n" ::);
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t Lds32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// A fragment of rows [0, 16) x columns [k0, k0 + 16) of a row-major tile (stride ld elements).
__device__ __forceinline__ void LoadA(uint32_t (&r)[4], const bf16* tile, int ld, int k0, int lane) {
  const int m = lane / 8, i = lane % 8;
  LdMatrix4(r, tile + (i + 8 * (m % 2)) * ld + k0 + 8 * (m / 2));
}
// A fragment of X^T rows [m0, m0 + 16) x columns [0, 16), X a 16-row row-major tile (stride ld):
// A[m][k] = X[k][m0 + m].
__device__ __forceinline__ void LoadAT(uint32_t (&r)[4], const bf16* tile, int ld, int m0, int lane) {
  const int m = lane / 8, i = lane % 8;
  LdMatrix4T(r, tile + (i + 8 * (m / 2)) * ld + m0 + 8 * (m % 2));
}
// B fragments of two k-steps (columns [k0, k0 + 32) of an 8-row row-major tile, B = tile^T):
// (r[0], r[1]) for k0, (r[2], r[3]) for k0 + 16.
// B fragments (r[0], r[1]) of B = tile[k0 .. k0 + 16)[n0 .. n0 + 8), tile row-major with K as its
// rows (stride ld), and (r[2], r[3]) of the next 8 columns n0 + 8.
__device__ __forceinline__ void LoadBRows(uint32_t (&r)[4], const bf16* tile, int ld, int k0, int n0, int lane) {
  const int m = lane / 8, i = lane % 8;
  LdMatrix4T(r, tile + (k0 + i + 8 * (m % 2)) * ld + n0 + 8 * (m / 2));
}
__device__ __forceinline__ void LoadB2(uint32_t (&r)[4], const bf16* tile, int ld, int k0, int lane) {
  const int m = lane / 8, i = lane % 8;
  LdMatrix4(r, tile + i * ld + k0 + 8 * m);
}

// B fragments of every k-step of an 8-row tile's C columns (B = tile^T; C a multiple of 32).
template <int C>
__device__ __forceinline__ void LoadBAll(uint32_t (&b)[C / 16][2], const bf16* tile, int ld, int lane) {
#pragma unroll
  for (int kk = 0; kk < C / 16; kk += 2) {
    uint32_t r[4];
    LoadB2(r, tile, ld, kk * 16, lane);
    b[kk][0] = r[0], b[kk][1] = r[1], b[kk + 1][0] = r[2], b[kk + 1][1] = r[3];
  }
}

// acc += tile (16 rows x C, row-major, stride ld) times B, its fragments from LoadBAll.
template <int C>
__device__ __forceinline__ void RowsTimesB(float (&acc)[4], const bf16* tile, int ld, const uint32_t (&b)[C / 16][2],
                                           int lane) {
#pragma unroll
  for (int kk = 0; kk < C / 16; ++kk) {
    uint32_t af[4];
    LoadA(af, tile, ld, kk * 16, lane);
    Mma(acc, af, b[kk][0], b[kk][1]);
  }
}

// A B operand carried as two bf16 parts (x's rounding and the remainder: ~16 bits of x).
struct SplitB {
  uint32_t hi0, hi1, lo0, lo1;
};
__device__ __forceinline__ void MmaSplit(float (&c)[4], const uint32_t (&a)[4], const SplitB& b) {
  Mma(c, a, b.hi0, b.hi1);
  Mma(c, a, b.lo0, b.lo1);
}
// acc[mt] += X^T rows [16 mt, 16 mt + 16) times b, for the C columns of X (a 16-row row-major
// tile, stride ld): K = X's 16 rows.
template <int C>
__device__ __forceinline__ void TransposedTimesB(float (&acc)[C / 16][4], const bf16* tile, int ld, const SplitB& b,
                                                 int lane) {
#pragma unroll
  for (int mt = 0; mt < C / 16; ++mt) {
    uint32_t af[4];
    LoadAT(af, tile, ld, mt * 16, lane);
    MmaSplit(acc[mt], af, b);
  }
}

}  // namespace odyssey::kernels::cuda::mma
