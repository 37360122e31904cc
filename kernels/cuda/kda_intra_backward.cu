// Chunked KDA's intra-chunk backward on CUDA (see kda_intra_backward.h): one block of
// kKdaIntraBackwardThreads threads per (batch x head, chunk), the phases of
// kda_intra_backward_body.h with a barrier after each.
#include "kernels/cuda/kda_intra_backward.h"

#include <cuda_runtime.h>

#include "kernels/cuda/kda_intra.h"
#include "kernels/cuda/kda_intra_backward_body.h"

namespace odyssey::kernels::cuda {
namespace {

template <int C, int K, bool kSub>
__global__ void __launch_bounds__(kKdaIntraBackwardThreads) IntraBackwardKernel(KdaIntraBackwardArgs a) {
  extern __shared__ float sm[];
  for (int phase = 0; phase < kda_bwd::Phases(C); ++phase) {
    kda_bwd::KdaIntraBackwardPhase<C, K, kSub>(phase, a, sm, blockIdx.y, blockIdx.x, threadIdx.x, blockDim.x);
    __syncthreads();
  }
}

template <int C, int K, bool kSub>
int Launch(const KdaIntraBackwardArgs& a, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(kda_bwd::SmemFloats(C, K, a.V)) * sizeof(float);
  // Above 48 KB of dynamic shared memory a kernel has to opt in (sm_90 allows 227 KB).
  const cudaError_t e = cudaFuncSetAttribute(&IntraBackwardKernel<C, K, kSub>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(bytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  const dim3 grid(static_cast<unsigned>(a.N), static_cast<unsigned>(a.B * a.HV));
  IntraBackwardKernel<C, K, kSub><<<grid, kKdaIntraBackwardThreads, bytes, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int KdaIntraBackward(const KdaIntraBackwardArgs& a, void* stream) {
  if (!KdaIntraBackwardSupported(a.C, a.K, a.V) || a.N <= 0 || a.B <= 0 || a.HV <= 0 || a.B * a.HV > 65535 ||
      a.N > 2147483647 || a.L > a.N * a.C) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const auto s = static_cast<cudaStream_t>(stream);
  return ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    constexpr int C = decltype(c)::value, K = decltype(k)::value;
    return a.sub_blocks ? Launch<C, K, true>(a, s) : Launch<C, K, false>(a, s);
  });
}

}  // namespace odyssey::kernels::cuda
