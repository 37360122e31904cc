// What the two implementations of chunked KDA's state scans share (device code only):
// kda_scan.cu (fp32 on CUDA cores) and kda_scan_tf32.cu (the tensor cores). Both run one block
// of kThreads threads per (batch x head, kBV value columns) and stream each chunk's operand
// tiles into shared memory with cp.async.
#pragma once

#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace odyssey::kernels::cuda::kda_scan {

constexpr int kThreads = 256;
constexpr int kBV = 32;  // state columns per block

// rows x cols floats (cols % 4 == 0) from global memory with row stride src_ld into shared
// memory with row stride ld, asynchronously, by a block of kNT threads (the caller commits and
// waits).
template <int kNT = kThreads>
__device__ __forceinline__ void Stage(float* dst, int ld, const float* src, int rows, int cols, int64_t src_ld) {
  const int per_row = cols / 4;
  for (int i = threadIdx.x; i < rows * per_row; i += kNT) {
    const int r = i / per_row, c = (i - r * per_row) * 4;
    __pipeline_memcpy_async(dst + r * ld + c, src + r * src_ld + c, 16);
  }
}

// Step j of a double-buffered pipeline of `total` stages: issues stage j + 1's copies where there
// is one (issue(j + 1) stages and commits them), waits for stage j's, and makes them visible to
// the block.
template <typename Issue>
__device__ __forceinline__ void PipelineStep(int64_t j, int64_t total, Issue&& issue) {
  if (j + 1 < total) {
    issue(j + 1);
    __pipeline_wait_prior(1);
  } else {
    __pipeline_wait_prior(0);
  }
  __syncthreads();
}

// One launch over the (V / kBV, BH) grid with `bytes` of dynamic shared memory; the launch's
// cudaError_t as an int.
template <typename Kernel, typename Args>
int Launch(Kernel* kernel, const Args& a, size_t bytes, cudaStream_t stream) {
  // Above 48 KB of dynamic shared memory a kernel has to opt in (sm_90 allows 227 KB).
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  const dim3 grid(static_cast<unsigned>(a.V / kBV), static_cast<unsigned>(a.BH));
  kernel<<<grid, kThreads, bytes, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace odyssey::kernels::cuda::kda_scan
