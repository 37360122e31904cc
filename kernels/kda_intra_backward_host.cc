// The host half of kernels/cuda/kda_intra_backward.h: the block's shared memory and the
// emulation that runs the block's code (kda_intra_backward_body.h) on the CPU, so the CPU tests
// check the code the CUDA kernel runs.
#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/cuda/kda_intra.h"
#include "kernels/cuda/kda_intra_backward.h"
#include "kernels/cuda/kda_intra_backward_body.h"

namespace odyssey::kernels::cuda {

int64_t KdaIntraBackwardSmemFloats(int64_t C, int64_t K, int64_t V) { return kda_bwd::SmemFloats(C, K, V); }

namespace {

template <int C, int K, bool kSub>
void Emulate(const KdaIntraBackwardArgs& a, bool reverse_threads) {
  constexpr int kThreads = kKdaIntraBackwardThreads;
  std::vector<float> sm(static_cast<size_t>(kda_bwd::SmemFloats(C, K, a.V)));
  for (int64_t bh = 0; bh < a.B * a.HV; ++bh) {
    for (int64_t n = 0; n < a.N; ++n) {
      // Shared memory starts as NaN: a read of anything no phase wrote shows in the outputs.
      std::fill(sm.begin(), sm.end(), std::numeric_limits<float>::quiet_NaN());
      for (int phase = 0; phase < kda_bwd::Phases(C); ++phase) {
        for (int i = 0; i < kThreads; ++i) {
          const int tid = reverse_threads ? kThreads - 1 - i : i;
          kda_bwd::KdaIntraBackwardPhase<C, K, kSub>(phase, a, sm.data(), bh, n, tid, kThreads);
        }
      }
    }
  }
}

}  // namespace

void KdaIntraBackwardOnHost(const KdaIntraBackwardArgs& a, bool reverse_threads) {
  ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    constexpr int C = decltype(c)::value, K = decltype(k)::value;
    if (a.sub_blocks) {
      Emulate<C, K, true>(a, reverse_threads);
    } else {
      Emulate<C, K, false>(a, reverse_threads);
    }
  });
}

}  // namespace odyssey::kernels::cuda
