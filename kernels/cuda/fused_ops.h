// Launchers of odyssey's memory-bound CUDA kernels (kernels/cuda/fused_ops.cu), over raw device
// pointers, so that this header needs neither the CUDA headers nor libtorch: kernels/fused_ops.cc
// checks shapes, dtypes, alignment and devices and calls these with the current stream.
//
// Every tensor is contiguous bf16 unless its name says fp32; rows are of length H (or D). The
// math is fp32 in registers with one rounding per output, so each kernel's error against an
// fp32 reference is at most that of the bf16 libtorch ops it replaces (kernels/fused_ops_test.cc
// measures the ratio). Each launcher returns the launch's cudaError_t as an int (0 = success).
// Only built with ODYSSEY_CUDA.
#pragma once

#include <cstdint>

namespace odyssey::kernels::cuda {

// y = w * bf16(x * rstd), rstd = rsqrt(mean(x^2) + eps) (fp32, written to rstd[N]): the
// RMSNorm of transformers, one pass. REQUIRES: H % 8 == 0, H <= kMaxNormWidth, 16-byte aligned.
constexpr int64_t kMaxNormWidth = 32768;
int RmsNormForward(const void* x, const void* w, void* y, float* rstd, int64_t N, int64_t H, float eps, void* stream);

// The backward of the above from the output gradient g: dx = rstd * (dn - n * mean(dn * n)) with
// n = x * rstd and dn = g * w (bf16 out), and dw = sum over rows of g * bf16(n) into dw[H] (fp32,
// overwritten). `partial` is fp32 scratch of RmsNormBackwardScratch(N, H) floats.
int64_t RmsNormBackwardScratch(int64_t N, int64_t H);
int RmsNormBackward(const void* g, const void* x, const void* w, const float* rstd, void* dx, float* dw,
                    float* partial, int64_t N, int64_t H, void* stream);

// h = silu(gate) * up over n elements.
int SwiGluForward(const void* gate, const void* up, void* h, int64_t n, void* stream);
// d gate = dh * up * s * (1 + gate * (1 - s)), d up = dh * silu(gate), s = sigmoid(gate).
int SwiGluBackward(const void* dh, const void* gate, const void* up, void* dgate, void* dup, int64_t n,
                   void* stream);

// Rotary embedding over x (B, S, Hh, D) with tables cos, sin (B, S, D):
// out[..., i] = x[i] cos[i] - x[i + D/2] sin[i], out[..., i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]
// for i < D/2; inverse = true applies the transpose (the backward: rotation by -theta). out may
// be x (in place). REQUIRES: D even.
int Rope(const void* x, const void* cos, const void* sin, void* out, int64_t B, int64_t S, int64_t Hh, int64_t D,
         bool inverse, void* stream);

// One AdamW update of n elements in torch.optim.AdamW's op order over fp32 master, exp_avg and
// exp_avg_sq, from the gradient (bf16, or fp32 when grad_fp32) times *grad_scale (a device
// scalar: the clipping coefficient, so the host never waits for the gradient norm), writing
// the rounded master into param (bf16; null when the parameter is its own fp32 master).
struct AdamWArgs {
  double lr, beta1, beta2, eps, weight_decay;  // weight_decay = 0 for parameters without decay
  double bias_correction1, bias_correction2;    // 1 - beta^step
};
int AdamW(void* param, const void* grad, bool grad_fp32, float* master, float* exp_avg, float* exp_avg_sq,
          const float* grad_scale, int64_t n, const AdamWArgs& args, void* stream);

// Text of a launch error (cudaGetErrorString).
const char* ErrorString(int error);

}  // namespace odyssey::kernels::cuda
