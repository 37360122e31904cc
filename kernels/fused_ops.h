// The memory-bound ops around the matmuls of a decoder layer, each with two paths: odyssey's
// CUDA kernel (kernels/cuda/fused_ops.cu: one pass, fp32 math in registers, one rounding per
// output) where the build has CUDA, the tensors are contiguous bf16 on a CUDA device and the
// shape suits the kernel; and a plain libtorch reference everywhere else (the CPU path, and
// what the kernel tests compare against). The reference paths reproduce transformers' op order,
// so the CPU model matches transformers bitwise.
//
// The residual adds are not here: the layers fold them into the output projections' GEMMs
// (addmm's beta = 1 epilogue), which reads the residual once and writes nothing extra, where a
// norm fused with the add would still have to write the sum.
//
// Thread safety: the functions hold no state; SetFusedKernels is process-wide (set it before
// training starts).
#pragma once

#include <cstdint>
#include <utility>

#include <torch/types.h>

namespace odyssey::kernels {

// Whether this build carries the CUDA kernels.
bool FusedKernelsBuilt();
// Turns the CUDA kernels off (true: use them where they apply, the default), so a benchmark can
// compare them with the reference ops in one build.
void SetFusedKernels(bool enabled);
bool FusedKernelsEnabled();
// CUDA kernel launches since the process started (tests check that a kernel, not the reference,
// ran; the benchmark reports them).
int64_t FusedKernelLaunches();

// For this library's other kernel files: counts one launch of an odyssey CUDA kernel and fails
// with the CUDA error text (naming `what`) when error != 0.
void CheckKernelLaunch(int error, const char* what);

// RMSNorm over rows as transformers computes it: y = w * (x * rstd).to(x.dtype) with
// rstd = rsqrt(mean(x^2) + eps) in fp32. x2d (N, H), w (H) -> y (N, H) in x's dtype; rstd
// (N, 1) fp32 is written when given. The reference runs over chunks of about chunk_elements
// elements, bounding its fp32 temporaries at long sequences (results do not depend on it).
torch::Tensor RmsNormRows(const torch::Tensor& x2d, const torch::Tensor& w, double eps, int64_t chunk_elements,
                          torch::Tensor* rstd_out);
// Its backward from the output gradient g (N, H): {dx (N, H) in x's dtype, dw (H) fp32}.
std::pair<torch::Tensor, torch::Tensor> RmsNormRowsBackward(const torch::Tensor& g, const torch::Tensor& x2d,
                                                            const torch::Tensor& w, const torch::Tensor& rstd,
                                                            int64_t chunk_elements);

// silu(gate) * up, differentiable. gate, up (..., I) -> (..., I). The kernel path saves gate and
// up for backward (autograd of the reference also saves silu(gate)).
torch::Tensor SwiGlu(const torch::Tensor& gate, const torch::Tensor& up);

// KDA's short convolution and its SiLU (model::ShortConv's weight): x (B, S, Ch), its
// first ctx rows only context; w (Ch, 1, Kw), a depthwise causal filter.
//   y[b, t, c] = silu(sum_j w[c, 0, j] x[b, ctx + t - (Kw - 1) + j, c]), rows before 0 zeros
// for t < S - ctx. Returns (B, S - ctx, Ch), differentiable in x and w. The kernel path (Ch % 8
// == 0, 2 <= Kw <= 4) saves only x and recomputes the convolution in backward; the reference
// (pad, depthwise conv1d, narrow, silu) saves the conv's input and output.
torch::Tensor ShortConvSilu(const torch::Tensor& x, const torch::Tensor& w, int64_t ctx);

// Rotary embedding, differentiable: x (B, S, Hh, D) rotated by cos, sin (B, S, D) in
// transformers' rotate-half form (x * cos + rotate_half(x) * sin). Returns (B, S, Hh, D).
torch::Tensor Rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// residual + x @ weight^T: x (..., K), weight (N, K), residual (..., N) -> (..., N). Where the
// kernels run, one addmm whose beta = 1 epilogue adds the residual (one rounding, no extra pass);
// elsewhere transformers' residual + linear(x, weight).
torch::Tensor AddLinear(const torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& weight);

// One AdamW update (torch.optim.AdamW's op order, in place) of fp32 master, exp_avg, exp_avg_sq
// from grad * grad_scale, then param = master rounded (skipped when param is master). grad_scale:
// an fp32 scalar tensor on the parameter's device (the clipping coefficient) or undefined (1).
// weight_decay = 0 for parameters without decay; bias corrections are 1 - beta^step.
struct AdamWStep {
  double lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2;
};
void AdamWUpdate(const torch::Tensor& param, const torch::Tensor& grad, const torch::Tensor& master,
                 const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq, const torch::Tensor& grad_scale,
                 const AdamWStep& step);

}  // namespace odyssey::kernels
