// Device memory statistics (peak allocated / reserved bytes of libtorch's CUDA caching
// allocator). On CPU devices and CPU-only builds every figure is 0.
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace odyssey::engine {

struct DeviceMemory {
  int64_t allocated = 0;       // bytes in tensors now
  int64_t peak_allocated = 0;  // since the last ResetPeakMemory
  int64_t reserved = 0;        // bytes the caching allocator holds from the driver now
  int64_t peak_reserved = 0;
  int64_t total = 0;           // the device's memory
};

DeviceMemory ReadDeviceMemory(torch::Device device);
void ResetPeakMemory(torch::Device device);
// Waits for all work queued on the device (no-op on CPU).
void SynchronizeDevice(torch::Device device);

}  // namespace odyssey::engine
