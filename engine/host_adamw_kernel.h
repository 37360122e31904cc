// The host AdamW kernel: one AdamW update over fp32 master weights and fp32 (or bf16) moments in
// host memory, and the bf16 conversions it needs. Plain C++ (no libtorch), built on its own with
// -fno-math-errno so its loops vectorize (sqrt need not set errno: v >= 0 there); no -march
// flags, so the baseline x86-64 build (SSE2) is what runs on every machine.
//
// The math is AdamW's device path (engine/optimizer.cc, torch.optim.AdamW's) op for op in fp32:
// the same scalars rounded to fp32 the way ATen rounds them, the same order of operations, no
// fused multiply-adds (the build is ISO C++: -ffp-contract=off), so on the CPU it matches the
// device path to the last bit except where ATen's own vectorized lerp uses an FMA (<= 1 ulp).
// Thread safety: pure functions; disjoint ranges may be updated from several threads at once.
#pragma once

#include <cstdint>

namespace odyssey::engine {

// fp32 -> bf16 bits with round-to-nearest-even, NaN -> 0x7FC0: c10::BFloat16's conversion
// (c10::detail::round_to_nearest_even), written with bit operations so loops over it vectorize.
inline uint16_t Bf16Bits(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t rounded = (u + UINT32_C(0x7FFF) + ((u >> 16) & 1)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}
// bf16 bits -> fp32 (exact).
inline float Bf16Value(uint16_t b) { return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16); }

// One step's hyperparameters, as AdamW::Step has them (doubles).
struct AdamWStep {
  double lr = 0;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  int64_t step = 1;         // the step being taken (1-based): bias corrections 1 - beta^step
  double grad_scale = 1;    // the clip factor the gradients are multiplied by (1: none)
};

// One parameter's constants for one step, rounded to fp32 as ATen rounds the device path's
// scalar arguments (engine/optimizer.cc: mul_, lerp_, mul_, addcmul_, div, add_, addcdiv_).
struct AdamWConstants {
  float decay = 1;            // 1 - lr * weight_decay; 1 for a parameter without decay
  float lerp_weight = 0.1f;   // 1 - beta1: exp_avg.lerp_(g, 1 - beta1)
  bool lerp_from_end = false; // ATen's lerp for weights >= 0.5 starts from `end`
  float beta2 = 0.95f;
  float one_minus_beta2 = 0.05f;
  float sqrt_bc2 = 1;         // sqrt(1 - beta2^step)
  float eps = 1e-8f;
  float step_size = 0;        // -lr / (1 - beta1^step)
  float grad_scale = 1;
  static AdamWConstants For(const AdamWStep& step, bool decay);
};

// The kernel: one AdamW update of n elements in place, over fp32 `master`, `exp_avg`,
// `exp_avg_sq`, from a gradient of n bf16 (grad_bf16) or fp32 elements multiplied by
// k.grad_scale; writes the rounded master into `param_bf16` when that is not null.
// param_bf16 may be `grad` itself (a bf16 gradient): the rounded parameter then replaces the
// gradient in place, so one pinned buffer carries the gradient down and the parameter up.
// Plain loops over raw pointers (auto-vectorized). REQUIRES: the arrays do not overlap, except
// param_bf16 == grad.
void HostAdamWUpdate(const AdamWConstants& k, int64_t n, const void* grad, bool grad_bf16, float* master,
                     float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16);
// The same with bf16 moments (bf16 bits; HostOptimizerOptions::bf16_moments): each moment is
// read widened to fp32 (exact), updated and used by the step in fp32 exactly as above, and stored
// rounded to nearest even (Bf16Bits). So the master and the bf16 output of one step equal
// HostAdamWUpdate's from the same (bf16-representable) moments; the rounding reaches the
// parameters only through what the next step reads. Same REQUIRES.
void HostAdamWUpdateBf16Moments(const AdamWConstants& k, int64_t n, const void* grad, bool grad_bf16, float* master,
                                uint16_t* exp_avg, uint16_t* exp_avg_sq, uint16_t* param_bf16);

}  // namespace odyssey::engine
