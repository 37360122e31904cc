// HostPool: the host memory that holds offloaded layer inputs, allocated once per job and
// reused across steps, with a budget.
//
// On CUDA the slots are page-locked (cudaHostAlloc) so device<->host copies run at full PCIe
// speed and asynchronously; we allocate them ourselves rather than through libtorch's caching
// host allocator, which rounds every block up to a power of two (an 88 GB pool would cost
// 128 GB). On CPU-only builds and devices the slots are ordinary memory, so the same code
// paths (slots, budget, reuse) run in CPU tests.
// Thread safety: one thread at a time (the training thread).
#pragma once

#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"

namespace odyssey::engine::memory {

class HostPool {
 public:
  // budget_bytes <= 0: no limit. pinned: page-locked memory (needs CUDA).
  HostPool(int64_t budget_bytes, bool pinned);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A host tensor of `numel` elements of `dtype` for slot `index`. The slot's memory is
  // allocated on first use and reused while later requests fit; a request that would take the
  // pool over its budget is an error that says by how much.
  absl::StatusOr<torch::Tensor> Slot(int64_t index, int64_t numel, torch::Dtype dtype);

  int64_t allocated_bytes() const { return allocated_; }
  int64_t budget_bytes() const { return budget_; }
  bool pinned() const { return pinned_; }

 private:
  struct Block {
    void* ptr = nullptr;
    int64_t bytes = 0;
  };
  void Free(Block& b);
  int64_t budget_;
  bool pinned_;
  int64_t allocated_ = 0;
  std::vector<Block> blocks_;
};

}  // namespace odyssey::engine::memory
