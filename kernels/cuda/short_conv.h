// Launchers of KDA's short convolution fused with its SiLU (kernels/cuda/short_conv.cu), over raw
// device pointers (no CUDA or libtorch headers here); kernels/fused_ops.cc's ShortConvSilu checks
// shapes, dtypes and alignment and calls these on the current stream.
//
// x (B, S, Ch) bf16 contiguous, its first `ctx` rows only context; w (Ch, Kw) bf16 contiguous (a
// depthwise, causal filter of Kw taps per channel); y and dy (B, n, Ch), n = S - ctx:
//   pre[b, t, c] = sum_j w[c, j] x[b, ctx + t - (Kw - 1) + j, c]   (rows before 0 are zeros)
//   y = silu(pre)
// fp32 math in registers, one rounding per output. REQUIRES: Ch % 8 == 0, 2 <= Kw <= 4,
// 0 <= ctx < S, 16-byte aligned pointers. Each launcher returns the launch's cudaError_t as an
// int (0 = success). Only built with ODYSSEY_CUDA.
#pragma once

#include <cstdint>

namespace odyssey::kernels::cuda {

int ShortConvSiluForward(const void* x, const void* w, void* y, int64_t B, int64_t S, int64_t Ch, int64_t Kw,
                         int64_t ctx, void* stream);

// The backward from dy: dx (B, S, Ch) bf16 (the context rows' too) and dw (Ch, Kw) fp32
// (overwritten), pre recomputed from x. Each thread walks a run of rows with the last Kw rows of
// x and of d pre in registers; dw's per-run partial sums go to `partial` (fp32 scratch of
// ShortConvBackwardScratch floats) and are summed in a fixed order (deterministic).
int64_t ShortConvBackwardScratch(int64_t B, int64_t S, int64_t Ch, int64_t Kw);
int ShortConvSiluBackward(const void* dy, const void* x, const void* w, void* dx, float* dw, float* partial,
                          int64_t B, int64_t S, int64_t Ch, int64_t Kw, int64_t ctx, void* stream);

}  // namespace odyssey::kernels::cuda
