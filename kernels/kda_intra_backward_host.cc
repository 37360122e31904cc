// The host half of kernels/cuda/kda_intra_backward.h: the emulation that runs the blocks' code
// (kda_intra_backward_body.h) on the CPU, so the CPU tests check the code the CUDA kernels run.
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kernels/cuda/kda_intra.h"
#include "kernels/cuda/kda_intra_backward.h"
#include "kernels/cuda/kda_intra_backward_body.h"

namespace odyssey::kernels::cuda {

namespace {

// Runs `phase(p, sm, bh, n, tid, carry)` for every block (bh, n) of the grid, its phases in order
// and each phase's threads one after another (reversed with `reverse_threads`), shared memory
// and every thread's carry (what the kernel keeps in registers from phase to phase) starting as
// NaN: a read of anything no phase wrote shows in the outputs.
template <class Carry, class Phase>
void Emulate(int64_t blocks_bh, int64_t blocks_n, int phases, int64_t smem_floats, bool reverse_threads,
             const Phase& phase) {
  constexpr int kThreads = kKdaIntraBackwardThreads;
  std::vector<float> sm(static_cast<size_t>(smem_floats));
  std::vector<Carry> carry(kThreads);
  for (int64_t bh = 0; bh < blocks_bh; ++bh) {
    for (int64_t n = 0; n < blocks_n; ++n) {
      std::fill(sm.begin(), sm.end(), std::numeric_limits<float>::quiet_NaN());
      for (Carry& c : carry) {
        auto* f = reinterpret_cast<float*>(&c);
        std::fill(f, f + sizeof(Carry) / sizeof(float), std::numeric_limits<float>::quiet_NaN());
      }
      for (int p = 0; p < phases; ++p) {
        for (int i = 0; i < kThreads; ++i) {
          const int tid = reverse_threads ? kThreads - 1 - i : i;
          phase(p, sm.data(), bh, n, tid, carry[tid]);
        }
      }
    }
  }
}

// The sub-block forward carries nothing between phases.
struct NoCarry {};

}  // namespace

// Both run the block code for q, k, v of one dtype (bf16 or fp32, as the kernels are built).
void KdaIntraSubBlockForwardOnHost(const KdaIntraArgs& a, bool reverse_threads) {
  if (!KdaQkvSameDtype(a.bf16)) throw std::invalid_argument("KDA block code: q, k and v of different dtypes");
  const bool in16 = KdaQkvBf16(a.bf16);
  ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    constexpr int C = decltype(c)::value, K = decltype(k)::value;
    Emulate<NoCarry>(a.B * a.HV, a.N, kda_bwd::sub_forward::Phases(C), kda_bwd::SmemFloats(C, K, a.V),
                     reverse_threads, [&](int p, float* sm, int64_t bh, int64_t n, int tid, NoCarry&) {
              if (in16) {
                kda_bwd::sub_forward::Phase<C, K, true>(p, a, sm, bh, n, tid, kKdaIntraBackwardThreads);
              } else {
                kda_bwd::sub_forward::Phase<C, K, false>(p, a, sm, bh, n, tid, kKdaIntraBackwardThreads);
              }
            });
  });
}

void KdaIntraBackwardOnHost(const KdaIntraBackwardArgs& a, bool reverse_threads) {
  if (!KdaQkvSameDtype(a.bf16)) throw std::invalid_argument("KDA block code: q, k and v of different dtypes");
  if (!KdaGradOutsValid(a)) {
    throw std::invalid_argument("KDA block code: a gradient without a destination, or dq, dk, dv not in q's dtype");
  }
  if (a.T != nullptr && a.sub_blocks) {
    throw std::invalid_argument("KDA block code: a given inverse T is for the whole-chunk Gram form only");
  }
  ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    constexpr int C = decltype(c)::value, K = decltype(k)::value;
    // The kernel also wants dW and dU on 16 bytes for this form (its cp.async rows); here they
    // are plain copies, and the tests' fresh tensors are aligned either way.
    const bool tc = a.tf32 && kda_bwd::TensorCoreForm(a.sub_blocks, a.V);
    auto by_input = [&](auto in16) {
      constexpr bool b16 = decltype(in16)::value;
      constexpr int nt = kKdaIntraBackwardThreads;
      const int phases = kda_bwd::Phases(C);
      const int64_t smem = kda_bwd::SmemFloats(C, K, a.V, tc);
      // A given T (the whole-chunk form's): the kernel's kGivenT instance, whose inverse phases
      // do nothing (the kernel skips them and their barriers).
      const bool given = a.T != nullptr;
      if (tc) {
        Emulate<kda_bwd::Carry<C, K, true>>(a.B * a.HV, a.N, phases, smem, reverse_threads,
                                            [&](int p, float* sm, int64_t bh, int64_t n, int tid, auto& carry) {
                                              if (given) {
                                                kda_bwd::KdaIntraBackwardPhase<C, K, false, true, b16, true>(
                                                    p, a, sm, bh, n, tid, nt, carry);
                                              } else {
                                                kda_bwd::KdaIntraBackwardPhase<C, K, false, true, b16>(p, a, sm, bh, n,
                                                                                                       tid, nt, carry);
                                              }
                                            });
      } else {
        Emulate<kda_bwd::Carry<C, K, false>>(
            a.B * a.HV, a.N, phases, smem, reverse_threads,
            [&](int p, float* sm, int64_t bh, int64_t n, int tid, auto& carry) {
              if (a.sub_blocks) {
                kda_bwd::KdaIntraBackwardPhase<C, K, true, false, b16>(p, a, sm, bh, n, tid, nt, carry);
              } else if (given) {
                kda_bwd::KdaIntraBackwardPhase<C, K, false, false, b16, true>(p, a, sm, bh, n, tid, nt, carry);
              } else {
                kda_bwd::KdaIntraBackwardPhase<C, K, false, false, b16>(p, a, sm, bh, n, tid, nt, carry);
              }
            });
      }
    };
    if (KdaQkvBf16(a.bf16)) {
      by_input(std::true_type{});
    } else {
      by_input(std::false_type{});
    }
  });
}

}  // namespace odyssey::kernels::cuda
