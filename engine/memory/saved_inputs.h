// SavedInputs: where the inputs saved by checkpointed blocks wait between forward and backward.
//
// Either on the device (kept as they are), or offloaded to a HostPool: device->host on a side
// stream that overlaps compute, and, during backward, the input of the block that runs next
// (slot i-1 while slot i recomputes) prefetched host->device on the same side stream. CUDA
// events order the copies against compute, and the caching allocator is told which stream
// still reads a block (recordStream) so no memory is reused under a copy in flight. The last
// `device_resident` slots (the first ones backward needs) stay on the device even when
// offloading: keeping them costs GPU memory the planner has found free, and saves their copies.
// On CPU the same code copies synchronously into the pool (for tests of the bookkeeping).
// Thread safety: one thread at a time (the training thread).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "engine/memory/host_pool.h"

namespace odyssey::engine::memory {

class SavedInputs {
 public:
  // pool == nullptr: keep everything on the device.
  SavedInputs(HostPool* pool, int64_t device_resident);
  ~SavedInputs();

  // Starts a step with `num_slots` saved inputs (the number of checkpointed blocks).
  void BeginStep(int64_t num_slots);
  // Forward: keeps or offloads x (B, S, H) for slot `slot`.
  absl::Status Save(int64_t slot, const torch::Tensor& x);
  // Forward: slot `slot` keeps nothing; its block recomputes its input in backward (and so
  // never takes it, and the slot above it prefetches nothing).
  void Regenerated(int64_t slot);
  // Backward: x of slot `slot` on its device, ready on the current stream; starts the prefetch
  // of slot - 1 unless `prefetch_below` is false (the caller calls Prefetch later). Each slot is
  // taken once per step.
  torch::Tensor Take(int64_t slot, bool prefetch_below = true);
  // Starts bringing slot `slot` back to the device if it is offloaded (not resident, not
  // regenerated, not already coming): a later Take finds it there or on its way.
  void Prefetch(int64_t slot);
  // Bytes of device memory held by saved inputs now.
  int64_t device_bytes() const;
  bool offloading() const { return pool_ != nullptr; }

 private:
  struct Entry;
  bool Resident(int64_t slot) const;
  void StartFetch(int64_t slot);

  HostPool* pool_;
  int64_t device_resident_;
  int64_t num_slots_ = 0;
  std::vector<std::unique_ptr<Entry>> entries_;
  struct Streams;
  std::unique_ptr<Streams> streams_;  // CUDA side stream and events; null on CPU
};

}  // namespace odyssey::engine::memory
