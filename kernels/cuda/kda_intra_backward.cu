// Chunked KDA's intra-chunk backward and the sub-block form's forward on CUDA (see
// kda_intra_backward.h): one block of kKdaIntraBackwardThreads threads per (batch x head,
// chunk), the phases of kda_intra_backward_body.h with a barrier after each.
#include "kernels/cuda/kda_intra_backward.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/kda_intra.h"
#include "kernels/cuda/kda_intra_backward_body.h"

namespace odyssey::kernels::cuda {
namespace {

// kIn16: q, k, v bf16 (else fp32), fixed at compile time so the loads of the inner loops carry no
// branch.
// kGivenT: the block reads T (KdaIntraBackwardArgs::T), and the inverse's row phases are skipped
// with their barriers.
template <int C, int K, bool kSub, bool kTc, bool kIn16, bool kGivenT = false>
__global__ void __launch_bounds__(kKdaIntraBackwardThreads) IntraBackwardKernel(KdaIntraBackwardArgs a) {
  extern __shared__ float sm[];
  kda_bwd::Carry<C, K, kTc> carry;  // the thread's registers from one phase to a later one
  for (int phase = 0; phase < kda_bwd::Phases(C); ++phase) {
    if (kGivenT && kda_bwd::InverseRowPhase(C, phase)) phase = kda_bwd::InverseRowPhaseEnd(C);
    kda_bwd::KdaIntraBackwardPhase<C, K, kSub, kTc, kIn16, kGivenT>(phase, a, sm, blockIdx.y, blockIdx.x, threadIdx.x,
                                                           kKdaIntraBackwardThreads, carry);
    __syncthreads();
  }
}

template <int C, int K, bool kIn16>
__global__ void __launch_bounds__(kKdaIntraBackwardThreads) SubBlockForwardKernel(KdaIntraArgs a) {
  extern __shared__ float sm[];
  for (int phase = 0; phase < kda_bwd::sub_forward::Phases(C); ++phase) {
    kda_bwd::sub_forward::Phase<C, K, kIn16>(phase, a, sm, blockIdx.y, blockIdx.x, threadIdx.x, blockDim.x);
    __syncthreads();
  }
}

// Sizes both kernels take (the arguments share these fields).
template <class Args>
bool Valid(const Args& a) {
  return KdaIntraBackwardSupported(a.C, a.K, a.V) && a.N > 0 && a.B > 0 && a.HV > 0 && a.B * a.HV <= 65535 &&
         a.N <= 2147483647 && a.L <= a.N * a.C && KdaQkvSameDtype(a.bf16);
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
    const auto s = static_cast<cudaStream_t>(stream);
    const int64_t floats = kda_bwd::SmemFloats(C, K, a.V);
    return KdaQkvBf16(a.bf16) ? Launch(&SubBlockForwardKernel<C, K, true>, a, floats, s)
                              : Launch(&SubBlockForwardKernel<C, K, false>, a, floats, s);
  });
}

int KdaIntraBackward(const KdaIntraBackwardArgs& a, void* stream) {
  const bool t_ok = a.T == nullptr || (!a.sub_blocks && KdaAligned(a.T, 16));
  if (!Valid(a) || !KdaGradOutsValid(a) || !t_ok) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return ByChunkAndKey(a.C, a.K, [&](auto c, auto k) {
    constexpr int C = decltype(c)::value, K = decltype(k)::value;
    // The tensor-core form copies dW's and dU's rows by 16-byte cp.async: it takes them only where
    // both start on 16 bytes (fresh allocations do; a view into the middle of one may not), and
    // the CUDA-core form, which loads them element by element, runs otherwise.
    const bool tc =
        a.tf32 && kda_bwd::TensorCoreForm(a.sub_blocks, a.V) && KdaAligned(a.dW, 16) && KdaAligned(a.dU, 16);
    const int64_t floats = kda_bwd::SmemFloats(C, K, a.V, tc);
    const auto s = static_cast<cudaStream_t>(stream);
    auto by_input = [&](auto in16) {
      constexpr bool b16 = decltype(in16)::value;
      if (tc) {
        return a.T != nullptr ? Launch(&IntraBackwardKernel<C, K, false, true, b16, true>, a, floats, s)
                              : Launch(&IntraBackwardKernel<C, K, false, true, b16>, a, floats, s);
      }
      if (a.sub_blocks) return Launch(&IntraBackwardKernel<C, K, true, false, b16>, a, floats, s);
      return a.T != nullptr ? Launch(&IntraBackwardKernel<C, K, false, false, b16, true>, a, floats, s)
                            : Launch(&IntraBackwardKernel<C, K, false, false, b16>, a, floats, s);
    };
    return KdaQkvBf16(a.bf16) ? by_input(std::true_type{}) : by_input(std::false_type{});
  });
}

}  // namespace odyssey::kernels::cuda
