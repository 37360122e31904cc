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

// The moments' storage: fp32 as is, or bf16 widened exactly when read and rounded to nearest
// even when stored (bf16 moments). The math between is the same fp32 either way. On values, not
// pointers, so the loop indexes its own __restrict pointers (through a helper's, g++ versions
// the loop for aliasing or leaves it scalar).
inline float Widen(float x) { return x; }
inline float Widen(uint16_t b) { return Bf16Value(b); }
template <typename Moment>
inline Moment Narrow(float x) {
  if constexpr (std::is_same_v<Moment, uint16_t>) {
    return Bf16Bits(x);
  } else {
    return x;
  }
}

// One loop per (moment storage, gradient type, bf16 output, lerp form): no branch inside (a
// select on a loop-invariant flag keeps g++ -O2 from vectorizing the loop).
// kInPlace: the bf16 gradient buffer receives the rounded parameter (element i is read before it
// is written), through one pointer so that no aliasing check keeps the loop scalar.
template <typename Moment, bool kBf16Grad, bool kBf16Out, bool kFromEnd, bool kInPlace = false>
void UpdateLoop(const AdamWConstants& k, int64_t n, const void* grad_v, float* __restrict master,
                Moment* __restrict exp_avg, Moment* __restrict exp_avg_sq, uint16_t* __restrict out_v) {
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
    const float m0 = Widen(exp_avg[i]);
    const float m = (kFromEnd ? g : m0) + coeff * (g - m0);          // exp_avg.lerp_(g, 1 - beta1)
    const float v = Widen(exp_avg_sq[i]) * beta2 + omb2 * g * g;     // mul_(beta2).addcmul_(g, g, 1 - beta2)
    const float denom = std::sqrt(v) / sqrt_bc2 + eps;               // (v.sqrt() / sqrt(bc2)).add_(eps)
    const float p = master[i] * decay + step_size * m / denom;       // mul_(1 - lr wd); addcdiv_(m, denom, -lr/bc1)
    // This step's update used m and v in fp32; bf16 moments round only what the next step reads.
    exp_avg[i] = Narrow<Moment>(m);
    exp_avg_sq[i] = Narrow<Moment>(v);
    master[i] = p;
    if constexpr (kBf16Out) out[i] = Bf16Bits(p);
  }
}

template <typename Moment, bool kBf16Grad, bool kBf16Out, bool kInPlace = false>
void Dispatch(const AdamWConstants& k, int64_t n, const void* grad, float* master, Moment* exp_avg,
              Moment* exp_avg_sq, uint16_t* out) {
  if (k.lerp_from_end) {
    UpdateLoop<Moment, kBf16Grad, kBf16Out, true, kInPlace>(k, n, grad, master, exp_avg, exp_avg_sq, out);
  } else {
    UpdateLoop<Moment, kBf16Grad, kBf16Out, false, kInPlace>(k, n, grad, master, exp_avg, exp_avg_sq, out);
  }
}

// Both public entries: the moments' storage is the only difference.
template <typename Moment>
void Update(const AdamWConstants& k, int64_t n, const void* grad, bool grad_bf16, float* master, Moment* exp_avg,
            Moment* exp_avg_sq, uint16_t* param_bf16) {
  if (grad_bf16) {
    if (param_bf16 == grad) {
      Dispatch<Moment, true, true, true>(k, n, grad, master, exp_avg, exp_avg_sq, nullptr);
    } else if (param_bf16 != nullptr) {
      Dispatch<Moment, true, true>(k, n, grad, master, exp_avg, exp_avg_sq, param_bf16);
    } else {
      Dispatch<Moment, true, false>(k, n, grad, master, exp_avg, exp_avg_sq, nullptr);
    }
  } else if (param_bf16 != nullptr) {
    Dispatch<Moment, false, true>(k, n, grad, master, exp_avg, exp_avg_sq, param_bf16);
  } else {
    Dispatch<Moment, false, false>(k, n, grad, master, exp_avg, exp_avg_sq, nullptr);
  }
}

}  // namespace

void HostAdamWUpdate(const AdamWConstants& k, int64_t n, const void* grad, bool grad_bf16, float* master,
                     float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16) {
  Update(k, n, grad, grad_bf16, master, exp_avg, exp_avg_sq, param_bf16);
}

void HostAdamWUpdateBf16Moments(const AdamWConstants& k, int64_t n, const void* grad, bool grad_bf16, float* master,
                                uint16_t* exp_avg, uint16_t* exp_avg_sq, uint16_t* param_bf16) {
  Update(k, n, grad, grad_bf16, master, exp_avg, exp_avg_sq, param_bf16);
}

}  // namespace odyssey::engine
