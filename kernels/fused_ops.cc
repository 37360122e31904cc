#include "kernels/fused_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>

#include <torch/torch.h>

#ifdef ODYSSEY_KERNELS_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/fused_ops.h"
#include "kernels/cuda/short_conv.h"
#endif

namespace odyssey::kernels {
namespace {

std::atomic<bool> g_enabled{true};
std::atomic<int64_t> g_launches{0};

#ifdef ODYSSEY_KERNELS_CUDA
// The kernels take contiguous bf16 CUDA tensors whose data starts on a 16-byte boundary.
bool Takes(const torch::Tensor& t) {
  return t.defined() && t.is_cuda() && t.scalar_type() == torch::kBFloat16 && t.is_contiguous() &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}
bool NormKernelApplies(const torch::Tensor& x2d, const torch::Tensor& w) {
  const int64_t H = x2d.size(1);
  return FusedKernelsEnabled() && Takes(x2d) && Takes(w) && H % 8 == 0 && H <= cuda::kMaxNormWidth &&
         w.numel() == H && w.device() == x2d.device();
}
void* Stream(const torch::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
void Check(int error, const char* what) { CheckKernelLaunch(error, what); }
#endif

// Rows per chunk of the reference norm: its fp32 temporaries are a few (rows, H) tensors, so at
// 1M tokens of a 3B model an unchunked norm would allocate 12 GiB per temporary.
int64_t NormChunkRows(int64_t H, int64_t chunk_elements) { return std::max<int64_t>(1, chunk_elements / H); }

torch::Tensor RotateHalf(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

#ifdef ODYSSEY_KERNELS_CUDA
class SwiGluFunction : public torch::autograd::Function<SwiGluFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor gate, torch::Tensor up) {
    c10::cuda::CUDAGuard guard(gate.device());
    torch::Tensor h = torch::empty_like(gate);
    Check(cuda::SwiGluForward(gate.data_ptr(), up.data_ptr(), h.data_ptr(), gate.numel(), Stream(gate)), "swiglu");
    ctx->save_for_backward({gate, up});
    return h;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor& gate = saved[0];
    c10::cuda::CUDAGuard guard(gate.device());
    torch::Tensor dh = grads[0].to(gate.scalar_type()).contiguous();
    torch::Tensor dgate = torch::empty_like(gate), dup = torch::empty_like(gate);
    Check(cuda::SwiGluBackward(dh.data_ptr(), gate.data_ptr(), saved[1].data_ptr(), dgate.data_ptr(), dup.data_ptr(),
                               gate.numel(), Stream(gate)),
          "swiglu backward");
    return {dgate, dup};
  }
};

// silu(conv(x)) of the rows after the first `rows` by the kernel (x, w as ShortConvSilu takes them).
torch::Tensor ShortConvSiluKernel(const torch::Tensor& x, const torch::Tensor& w, int64_t rows) {
  c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty({x.size(0), x.size(1) - rows, x.size(2)}, x.options());
  Check(cuda::ShortConvSiluForward(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.size(0), x.size(1), x.size(2),
                                   w.size(2), rows, Stream(x)),
        "short conv silu");
  return y;
}

class ShortConvSiluFunction : public torch::autograd::Function<ShortConvSiluFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor w,
                               int64_t rows) {
    torch::Tensor y = ShortConvSiluKernel(x, w, rows);
    ctx->save_for_backward({x, w});
    ctx->saved_data["rows"] = rows;
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const int64_t rows = ctx->saved_data["rows"].toInt();
    c10::cuda::CUDAGuard guard(x.device());
    const int64_t B = x.size(0), S = x.size(1), Ch = x.size(2), Kw = w.size(2);
    torch::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    if (reinterpret_cast<uintptr_t>(dy.data_ptr()) % 16 != 0) dy = dy.clone();
    torch::Tensor dx = torch::empty_like(x);
    auto f32 = x.options().dtype(torch::kFloat32);
    torch::Tensor dw = torch::empty({Ch, 1, Kw}, f32);
    torch::Tensor partial = torch::empty({cuda::ShortConvBackwardScratch(B, S, Ch, Kw)}, f32);
    Check(cuda::ShortConvSiluBackward(dy.data_ptr(), x.data_ptr(), w.data_ptr(), dx.data_ptr(), dw.data_ptr<float>(),
                                      partial.data_ptr<float>(), B, S, Ch, Kw, rows, Stream(x)),
          "short conv silu backward");
    return {dx, dw.to(w.scalar_type()), torch::Tensor()};
  }
};

void RopeKernel(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& out,
                bool inverse) {
  Check(cuda::Rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), x.size(0), x.size(1), x.size(2),
                   x.size(3), inverse, Stream(x)),
        "rope");
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor cos,
                               torch::Tensor sin) {
    c10::cuda::CUDAGuard guard(x.device());
    // Out of place: x is a view of the projection's output, which nothing else keeps, so it is
    // freed as soon as this returns; writing into it would only add autograd view bookkeeping.
    torch::Tensor out = torch::empty_like(x);
    RopeKernel(x, cos, sin, out, /*inverse=*/false);
    ctx->save_for_backward({cos, sin});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    c10::cuda::CUDAGuard guard(saved[0].device());
    torch::Tensor g = grads[0].to(saved[0].scalar_type()).contiguous();
    torch::Tensor dx = torch::empty_like(g);
    RopeKernel(g, saved[0], saved[1], dx, /*inverse=*/true);  // the rotation's transpose
    return {dx, torch::Tensor(), torch::Tensor()};
  }
};
#endif

}  // namespace

bool FusedKernelsBuilt() {
#ifdef ODYSSEY_KERNELS_CUDA
  return true;
#else
  return false;
#endif
}
void SetFusedKernels(bool enabled) { g_enabled = enabled; }
bool FusedKernelsEnabled() { return g_enabled && FusedKernelsBuilt(); }
int64_t FusedKernelLaunches() { return g_launches.load(std::memory_order_relaxed); }
void CheckKernelLaunch(int error, const char* what) {
  g_launches.fetch_add(1, std::memory_order_relaxed);
#ifdef ODYSSEY_KERNELS_CUDA
  TORCH_CHECK(error == 0, "odyssey kernel ", what, " failed to launch: ", cuda::ErrorString(error));
#else
  TORCH_CHECK(error == 0, "odyssey kernel ", what, " failed to launch (error ", error, ")");
#endif
}

torch::Tensor RmsNormRows(const torch::Tensor& x2d, const torch::Tensor& w, double eps, int64_t chunk_elements,
                          torch::Tensor* rstd_out) {
  const int64_t N = x2d.size(0), H = x2d.size(1);
  torch::Tensor y = torch::empty_like(x2d);                                          // (N, H)
  torch::Tensor rstd = torch::empty({N, 1}, x2d.options().dtype(torch::kFloat32));  // (N, 1)
#ifdef ODYSSEY_KERNELS_CUDA
  if (NormKernelApplies(x2d, w)) {
    c10::cuda::CUDAGuard guard(x2d.device());
    Check(cuda::RmsNormForward(x2d.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr<float>(), N, H,
                               static_cast<float>(eps), Stream(x2d)),
          "rmsnorm");
    if (rstd_out != nullptr) *rstd_out = rstd;
    return y;
  }
#endif
  const int64_t chunk = NormChunkRows(H, chunk_elements);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    torch::Tensor xf = x2d.narrow(0, r0, n).to(torch::kFloat32);                // (n, H)
    torch::Tensor r = torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);  // (n, 1)
    y.narrow(0, r0, n).copy_(w * (xf * r).to(x2d.scalar_type()));
    rstd.narrow(0, r0, n).copy_(r);
  }
  if (rstd_out != nullptr) *rstd_out = rstd;
  return y;
}

std::pair<torch::Tensor, torch::Tensor> RmsNormRowsBackward(const torch::Tensor& g_in, const torch::Tensor& x,
                                                            const torch::Tensor& w, const torch::Tensor& rstd,
                                                            int64_t chunk_elements) {
  const int64_t N = x.size(0), H = x.size(1);
  torch::Tensor dx = torch::empty_like(x);                                         // (N, H)
  torch::Tensor dw = torch::zeros({H}, w.options().dtype(torch::kFloat32));  // (H,)
#ifdef ODYSSEY_KERNELS_CUDA
  if (NormKernelApplies(x, w)) {
    c10::cuda::CUDAGuard guard(x.device());
    torch::Tensor g = g_in.to(x.scalar_type()).contiguous();
    torch::Tensor partial = torch::empty({cuda::RmsNormBackwardScratch(N, H)}, dw.options());  // (blocks * H,)
    torch::Tensor r = rstd.contiguous();
    Check(cuda::RmsNormBackward(g.data_ptr(), x.data_ptr(), w.data_ptr(), r.data_ptr<float>(), dx.data_ptr(),
                                dw.data_ptr<float>(), partial.data_ptr<float>(), N, H, Stream(x)),
          "rmsnorm backward");
    return {dx, dw};
  }
#endif
  const int64_t chunk = NormChunkRows(H, chunk_elements);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    torch::Tensor r = rstd.narrow(0, r0, n);
    torch::Tensor gc = g_in.narrow(0, r0, n);
    torch::Tensor nrm = x.narrow(0, r0, n).to(torch::kFloat32) * r;  // (n, H) fp32
    torch::Tensor dn = (gc * w).to(torch::kFloat32);                  // through the cast
    dx.narrow(0, r0, n).copy_(r * (dn - nrm * (dn * nrm).mean(-1, /*keepdim=*/true)));
    dw.add_((gc.to(torch::kFloat32) * nrm.to(x.scalar_type()).to(torch::kFloat32)).sum(0));
  }
  return {dx, dw};
}

torch::Tensor SwiGlu(const torch::Tensor& gate, const torch::Tensor& up) {
#ifdef ODYSSEY_KERNELS_CUDA
  if (FusedKernelsEnabled() && Takes(gate) && Takes(up) && gate.sizes() == up.sizes() &&
      gate.device() == up.device()) {
    if (torch::GradMode::is_enabled() && (gate.requires_grad() || up.requires_grad()))
      return SwiGluFunction::apply(gate, up);
    c10::cuda::CUDAGuard guard(gate.device());
    torch::Tensor h = torch::empty_like(gate);
    Check(cuda::SwiGluForward(gate.data_ptr(), up.data_ptr(), h.data_ptr(), gate.numel(), Stream(gate)), "swiglu");
    return h;
  }
#endif
  return torch::silu(gate) * up;
}

torch::Tensor ShortConvSilu(const torch::Tensor& x, const torch::Tensor& w, int64_t ctx) {
  TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && w.size(0) == x.size(2) && w.size(1) == 1 && w.size(2) >= 1,
              "ShortConvSilu: x must be (B, S, Ch) and w (Ch, 1, Kw); got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(ctx >= 0 && ctx < x.size(1), "ShortConvSilu: ctx (", ctx, ") must be in [0, S = ", x.size(1), ")");
  const int64_t Kw = w.size(2);
#ifdef ODYSSEY_KERNELS_CUDA
  if (FusedKernelsEnabled() && Takes(x) && Takes(w) && x.size(2) % 8 == 0 && Kw >= 2 && Kw <= 4 &&
      w.device() == x.device() && x.size(0) > 0) {
    if (torch::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad()))
      return ShortConvSiluFunction::apply(x, w, ctx);
    return ShortConvSiluKernel(x, w, ctx);
  }
#endif
  // The reference: pad, depthwise conv1d (groups = Ch), then silu on the kept rows.
  torch::Tensor xt = torch::constant_pad_nd(x.transpose(1, 2), {Kw - 1, 0});  // (B, Ch, S + Kw - 1)
  const int64_t one = 1, zero = 0;
  torch::Tensor conv = torch::conv1d(xt, w, torch::Tensor(), torch::IntArrayRef(one), torch::IntArrayRef(zero),
                                     torch::IntArrayRef(one), w.size(0))
                           .transpose(1, 2);  // (B, S, Ch)
  return torch::silu(conv.narrow(1, ctx, x.size(1) - ctx));
}

torch::Tensor Rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
#ifdef ODYSSEY_KERNELS_CUDA
  if (FusedKernelsEnabled() && x.dim() == 4 && Takes(x) && Takes(cos) && Takes(sin) && x.size(3) % 2 == 0 &&
      cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(1) &&
      cos.size(2) == x.size(3) && cos.device() == x.device()) {
    if (torch::GradMode::is_enabled() && x.requires_grad()) return RopeFunction::apply(x, cos, sin);
    c10::cuda::CUDAGuard guard(x.device());
    torch::Tensor out = torch::empty_like(x);
    RopeKernel(x, cos, sin, out, /*inverse=*/false);
    return out;
  }
#endif
  // transformers' op order and layout: on the (B, Hh, S, D) view, so the result has the same
  // strides as theirs and the attention after it runs the same BLAS calls (bitwise parity).
  torch::Tensor xt = x.transpose(1, 2);  // (B, Hh, S, D)
  torch::Tensor c = cos.unsqueeze(1);    // (B, 1, S, D)
  torch::Tensor s = sin.unsqueeze(1);
  return (xt * c + RotateHalf(xt) * s).transpose(1, 2);
}

torch::Tensor AddLinear(const torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& weight) {
  if (FusedKernelsEnabled() && residual.is_cuda() && residual.is_contiguous() && x.is_contiguous() &&
      residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type()) {
    const int64_t N = weight.size(0), K = weight.size(1);
    return torch::addmm(residual.view({-1, N}), x.view({-1, K}), weight.t()).view(residual.sizes());
  }
  return residual + torch::nn::functional::linear(x, weight);
}

void AdamWUpdate(const torch::Tensor& param, const torch::Tensor& grad, const torch::Tensor& master,
                 const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq, const torch::Tensor& grad_scale,
                 const AdamWStep& a) {
  torch::NoGradGuard no_grad;
  const bool own_master = param.is_same(master);
#ifdef ODYSSEY_KERNELS_CUDA
  auto fp32_cuda = [&](const torch::Tensor& t) {
    return t.is_cuda() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device() == param.device() &&
           t.numel() == param.numel();
  };
  const bool grad_ok = grad.device() == param.device() && grad.is_contiguous() && grad.numel() == param.numel() &&
                       (grad.scalar_type() == torch::kBFloat16 || grad.scalar_type() == torch::kFloat32);
  const bool param_ok = own_master || (param.scalar_type() == torch::kBFloat16 && param.is_contiguous());
  if (FusedKernelsEnabled() && param.is_cuda() && grad_ok && param_ok && fp32_cuda(master) && fp32_cuda(exp_avg) &&
      fp32_cuda(exp_avg_sq) &&
      (!grad_scale.defined() || (grad_scale.is_cuda() && grad_scale.scalar_type() == torch::kFloat32 &&
                                 grad_scale.numel() == 1 && grad_scale.device() == param.device()))) {
    c10::cuda::CUDAGuard guard(param.device());
    const cuda::AdamWArgs args{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.bias_correction1,
                               a.bias_correction2};
    Check(cuda::AdamW(own_master ? nullptr : param.data_ptr(), grad.data_ptr(),
                      grad.scalar_type() == torch::kFloat32, master.data_ptr<float>(), exp_avg.data_ptr<float>(),
                      exp_avg_sq.data_ptr<float>(), grad_scale.defined() ? grad_scale.data_ptr<float>() : nullptr,
                      param.numel(), args, Stream(param)),
          "adamw");
    return;
  }
#endif
  torch::Tensor g = grad.to(torch::kFloat32);  // (param shape)
  if (grad_scale.defined()) g = g * grad_scale.to(g.device());
  if (a.weight_decay > 0) master.mul_(1 - a.lr * a.weight_decay);
  exp_avg.lerp_(g, 1 - a.beta1);
  exp_avg_sq.mul_(a.beta2).addcmul_(g, g, 1 - a.beta2);
  torch::Tensor denom = (exp_avg_sq.sqrt() / std::sqrt(a.bias_correction2)).add_(a.eps);
  master.addcdiv_(exp_avg, denom, -a.lr / a.bias_correction1);
  if (!own_master) param.copy_(master);
}

}  // namespace odyssey::kernels
