#include "engine/host_adamw_kernel.h"

#include <cmath>
#include <type_traits>

namespace odyssey::engine {

AdamWConstants AdamWConstants::For(const AdamWStep& s, bool decay) {
  // The scalars in double, then rounded once to fp32: what ATen does with a double Scalar
  // argument to an fp32 tensor op.
  const double bc1 = 1 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1 - std::pow(s.beta2, static_cast<double>(s.step));
  AdamWConstants k;
  k.decay = decay && s.weight_decay > 0 ? static_cast<float>(1 - s.lr * s.weight_decay) : 1.0f;
  k.lerp_weight = static_cast<float>(1 - s.beta1);
  k.lerp_from_end = !(std::abs(k.lerp_weight) < 0.5f);  // ATen's is_lerp_weight_small
  k.beta2 = static_cast<float>(s.beta2);
  k.one_minus_beta2 = static_cast<float>(1 - s.beta2);
  k.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  k.eps = static_cast<float>(s.eps);
  k.step_size = static_cast<float>(-s.lr / bc1);
  k.grad_scale = static_cast<float>(s.grad_scale);
  return k;
}

namespace {

// One loop per (gradient type, bf16 output, lerp form): no branch inside (a select on a
// loop-invariant flag keeps g++ -O2 from vectorizing the loop).
// kInPlace: the bf16 gradient buffer receives the rounded parameter (element i is read before it
// is written), through one pointer so that no aliasing check keeps the loop scalar.
template <bool kBf16Grad, bool kBf16Out, bool kFromEnd, bool kInPlace = false>
void UpdateLoop(const AdamWConstants& k, int64_t n, const void* grad_v, float* __restrict master,
                float* __restrict exp_avg, float* __restrict exp_avg_sq, uint16_t* __restrict out_v) {
  static_assert(!kInPlace || (kBf16Grad && kBf16Out));
  uint16_t* __restrict out = kInPlace ? static_cast<uint16_t*>(const_cast<void*>(grad_v)) : out_v;
  const uint16_t* __restrict grad16 = kInPlace ? out : static_cast<const uint16_t*>(grad_v);
  const float* __restrict grad32 = static_cast<const float*>(grad_v);
  // ATen's lerp: self + w * (end - self) for w < 0.5, else end - (end - self) * (1 - w), which
  // is end + (w - 1) * (end - self) exactly (fl(w - 1) = -fl(1 - w)).
  const float coeff = kFromEnd ? k.lerp_weight - 1.0f : k.lerp_weight;
  const float decay = k.decay, beta2 = k.beta2, omb2 = k.one_minus_beta2, sqrt_bc2 = k.sqrt_bc2, eps = k.eps,
              step_size = k.step_size, scale = k.grad_scale;
  for (int64_t i = 0; i < n; ++i) {
    float g;
    if constexpr (kBf16Grad) {
      g = Bf16Value(grad16[i]) * scale;
    } else {
      g = grad32[i] * scale;
    }
    const float m0 = exp_avg[i];
    const float m = (kFromEnd ? g : m0) + coeff * (g - m0);    // exp_avg.lerp_(g, 1 - beta1)
    const float v = exp_avg_sq[i] * beta2 + omb2 * g * g;       // mul_(beta2).addcmul_(g, g, 1 - beta2)
    const float denom = std::sqrt(v) / sqrt_bc2 + eps;          // (v.sqrt() / sqrt(bc2)).add_(eps)
    const float p = master[i] * decay + step_size * m / denom;  // mul_(1 - lr wd); addcdiv_(m, denom, -lr/bc1)
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    master[i] = p;
    if constexpr (kBf16Out) out[i] = Bf16Bits(p);
  }
}

template <bool kBf16Grad, bool kBf16Out, bool kInPlace = false>
void Dispatch(const AdamWConstants& k, int64_t n, const void* grad, float* master, float* exp_avg, float* exp_avg_sq,
              uint16_t* out) {
  if (k.lerp_from_end) {
    UpdateLoop<kBf16Grad, kBf16Out, true, kInPlace>(k, n, grad, master, exp_avg, exp_avg_sq, out);
  } else {
    UpdateLoop<kBf16Grad, kBf16Out, false, kInPlace>(k, n, grad, master, exp_avg, exp_avg_sq, out);
  }
}

}  // namespace

void HostAdamWUpdate(const AdamWConstants& k, int64_t n, const void* grad, bool grad_bf16, float* master,
                     float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16) {
  if (grad_bf16) {
    if (param_bf16 == grad) {
      Dispatch<true, true, true>(k, n, grad, master, exp_avg, exp_avg_sq, nullptr);
    } else if (param_bf16 != nullptr) {
      Dispatch<true, true>(k, n, grad, master, exp_avg, exp_avg_sq, param_bf16);
    } else {
      Dispatch<true, false>(k, n, grad, master, exp_avg, exp_avg_sq, nullptr);
    }
  } else if (param_bf16 != nullptr) {
    Dispatch<false, true>(k, n, grad, master, exp_avg, exp_avg_sq, param_bf16);
  } else {
    Dispatch<false, false>(k, n, grad, master, exp_avg, exp_avg_sq, nullptr);
  }
}

}  // namespace odyssey::engine
