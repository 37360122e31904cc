#include "engine/device_stats.h"

#ifdef ODYSSEY_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace odyssey::engine {
namespace {

#ifdef ODYSSEY_WITH_CUDA
// libtorch sizes the caching allocator's per-device state when CUDA is first used (lazily, by
// the first CUDA tensor); asking it for statistics before that throws "Invalid device argument".
// A worker probes its device's memory before it has made a tensor, so initialize first.
// Returns false for a device index this process cannot use.
bool CudaReady(torch::Device device) {
  if (device.index() < 0 || device.index() >= c10::cuda::device_count()) return false;
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  return true;
}
#endif

}  // namespace

DeviceMemory ReadDeviceMemory(torch::Device device) {
  DeviceMemory m;
#ifdef ODYSSEY_WITH_CUDA
  if (device.is_cuda() && CudaReady(device)) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    m.allocated = stats.allocated_bytes[all].current;
    m.peak_allocated = stats.allocated_bytes[all].peak;
    m.reserved = stats.reserved_bytes[all].current;
    m.peak_reserved = stats.reserved_bytes[all].peak;
    size_t free_bytes = 0, total_bytes = 0;
    c10::cuda::CUDAGuard guard(device.index());
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) m.total = static_cast<int64_t>(total_bytes);
  }
#endif
  return m;
}

void ResetPeakMemory(torch::Device device) {
#ifdef ODYSSEY_WITH_CUDA
  if (device.is_cuda() && CudaReady(device)) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
}

void SynchronizeDevice(torch::Device device) {
#ifdef ODYSSEY_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
}

}  // namespace odyssey::engine
