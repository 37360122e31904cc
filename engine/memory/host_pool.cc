#include "engine/memory/host_pool.h"

#include <algorithm>
#include <cstdlib>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#ifdef ODYSSEY_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace odyssey::engine::memory {
namespace {
std::string GiB(int64_t bytes) { return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (1 << 30)); }
}  // namespace

HostPool::HostPool(int64_t budget_bytes, bool pinned) : budget_(budget_bytes), pinned_(pinned) {
#ifndef ODYSSEY_WITH_CUDA
  pinned_ = false;
#endif
}

HostPool::~HostPool() {
  for (Block& b : blocks_) Free(b);
}

void HostPool::Free(Block& b) {
  if (b.ptr == nullptr) return;
#ifdef ODYSSEY_WITH_CUDA
  if (pinned_) {
    cudaFreeHost(b.ptr);
  } else {
    std::free(b.ptr);
  }
#else
  std::free(b.ptr);
#endif
  allocated_ -= b.bytes;
  b = Block{};
}

absl::StatusOr<torch::Tensor> HostPool::Slot(int64_t index, int64_t numel, torch::Dtype dtype) {
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (index >= static_cast<int64_t>(blocks_.size())) blocks_.resize(index + 1);
  Block& b = blocks_[index];
  if (b.bytes < bytes) {
    const int64_t after = allocated_ - b.bytes + bytes;
    if (budget_ > 0 && after > budget_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "host offload pool: slot ", index, " needs ", GiB(bytes), ", which takes the pool to ", GiB(after),
          ", over memory.host_budget_bytes (", GiB(budget_), ") by ", GiB(after - budget_),
          "; keep more layer inputs on the GPU, checkpoint every k layers, or raise the budget"));
    }
    // A slot that grows (RL calls of varying length) grows by half again, so a session of
    // slowly growing requests reallocates a few times, not on every call (each cudaHostAlloc of
    // many GiB takes seconds); never past the budget, and the first size is exact.
    int64_t grown = bytes;
    if (b.bytes > 0) {
      grown = std::max(bytes, b.bytes + b.bytes / 2);
      if (budget_ > 0) grown = std::min(grown, budget_ - (allocated_ - b.bytes));
    }
#ifdef ODYSSEY_WITH_CUDA
    // Copies to or from the old block may still be in flight on a side stream: wait for them
    // before its memory goes back (cudaFreeHost does not wait for asynchronous copies).
    if (pinned_ && b.ptr != nullptr) cudaDeviceSynchronize();
#endif
    Free(b);
    const int64_t alloc_bytes = grown;
    void* ptr = nullptr;
#ifdef ODYSSEY_WITH_CUDA
    if (pinned_) {
      if (cudaHostAlloc(&ptr, alloc_bytes, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        return absl::ResourceExhaustedError(absl::StrCat("host offload pool: cudaHostAlloc of ", GiB(alloc_bytes),
                                                         " for slot ", index, " failed (pool holds ",
                                                         GiB(allocated_), ")"));
      }
    } else {
      ptr = std::malloc(alloc_bytes);
    }
#else
    ptr = std::malloc(alloc_bytes);
#endif
    if (ptr == nullptr)
      return absl::ResourceExhaustedError(absl::StrCat("host offload pool: cannot allocate ", GiB(alloc_bytes)));
    b.ptr = ptr;
    b.bytes = alloc_bytes;
    allocated_ += alloc_bytes;
  }
  // A view of the slot; the pool owns the memory (no deleter).
  return torch::from_blob(b.ptr, {numel}, torch::TensorOptions().dtype(dtype).device(torch::kCPU));
}

}  // namespace odyssey::engine::memory
