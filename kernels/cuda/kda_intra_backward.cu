// Chunked KDA's intra-chunk backward and the sub-block form's forward on CUDA (see
// kda_intra_backward.h): one block of kKdaIntraBackwardThreads threads per (batch x head,
// chunk), the phases of kda_intra_backward_body.h with a barrier after each.
#include "kernels/cuda/kda_intra_backward.h"

#include <cuda_runtime.h>

#include "kernels/cuda/kda_intra.h"
#include "kernels/cuda/kda_intra_backward_body.h"

namespace odyssey::kernels::cuda {
namespace {

template <int C, int K, bool kSub, bool kTc>
__global__ void __launch_bounds__(kKdaIntraBackwardThreads) IntraBackwardKernel(KdaIntraBackwardArgs a) {
  extern __shared__ float sm[];
  for (int phase = 0; phase < kda_bwd::Phases(C); ++phase) {
    kda_bwd::KdaIntraBackwardPhase<C, K, kSub, kTc>(phase, a, sm, blockIdx.y, blockIdx.x, threadIdx.x, blockDim.x);
    __syncthreads();
  }
}

template <int C, int K>
__global__ void __launch_bounds__(kKdaIntraBackwardThreads) SubBlockForwardKernel(KdaIntraArgs a) {
  extern __shared__ float sm[];
  for (int phase = 0; phase < kda_bwd::sub_forward::Phases(C); ++phase) {
    kda_bwd::sub_forward::Phase<C, K>(phase, a, sm, blockIdx.y, blockIdx.x, threadIdx.x, blockDim.x);
    __syncthreads();
  }
}

// Sizes both kernels take (the arguments share these fields).
template <class Args>
bool Valid(const Args& a) {
  return KdaIntraBackwardSupported(a.C, a.K, a.V) && a.N > 0 && a.B > 0 && a.HV > 0 && a.B * a.HV <= 65535 &&
         a.N <= 2147483647 && a.L <= a.N * a.C;
}

// One block per (chunk, batch x head) with the block's shared memory.
template <class Args>
int Launch(void (*kernel)(Args), const Args& a, int64_t smem_floats, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(smem_floats) * sizeof(float);
  // Above 48 KB of dynamic shared memory a kernel has to opt in (sm_90 allows 227 KB).
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  const dim3 grid(static_cast<unsigned>(a.N), static_cast<unsigned>(a.B * a.HV));
  kernel<<<grid, kKdaIntraBackwardThreads, bytes, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int KdaIntraSubBlockForward(const KdaIntraArgs& a, void* stream) {
  if (!Valid(a)) return static_cast<int>(cudaErrorInvalidValue);
  return ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    constexpr int C = decltype(c)::value, K = decltype(k)::value;
    return Launch(&SubBlockForwardKernel<C, K>, a, kda_bwd::SmemFloats(C, K, a.V), static_cast<cudaStream_t>(stream));
  });
}

int KdaIntraBackward(const KdaIntraBackwardArgs& a, void* stream) {
  if (!Valid(a)) return static_cast<int>(cudaErrorInvalidValue);
  return ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    constexpr int C = decltype(c)::value, K = decltype(k)::value;
    const bool tc = a.tf32 && kda_bwd::TensorCoreForm(a.sub_blocks, a.V);
    const int64_t floats = kda_bwd::SmemFloats(C, K, a.V, tc);
    const auto s = static_cast<cudaStream_t>(stream);
    if (tc) return Launch(&IntraBackwardKernel<C, K, false, true>, a, floats, s);
    return a.sub_blocks ? Launch(&IntraBackwardKernel<C, K, true, false>, a, floats, s)
                        : Launch(&IntraBackwardKernel<C, K, false, false>, a, floats, s);
  });
}

}  // namespace odyssey::kernels::cuda
