#include "engine/memory/saved_inputs.h"

#include <torch/torch.h>

#ifdef ODYSSEY_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace odyssey::engine::memory {

struct SavedInputs::Entry {
  torch::Tensor device;      // on the device: resident, or fetched back
  torch::Tensor host;        // pool slot view (B, S, H) when offloaded
  std::vector<int64_t> sizes;
  torch::Device dev{torch::kCPU};
  bool fetching = false;
  bool regenerated = false;  // nothing kept: the block recomputes its input
#ifdef ODYSSEY_WITH_CUDA
  at::cuda::CUDAEvent offloaded;  // device->host copy done
  at::cuda::CUDAEvent fetched;    // host->device copy done
#endif
};

struct SavedInputs::Streams {
#ifdef ODYSSEY_WITH_CUDA
  explicit Streams(c10::DeviceIndex index) : copy(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)) {}
  c10::cuda::CUDAStream copy;
#endif
};

SavedInputs::SavedInputs(HostPool* pool, int64_t device_resident) : pool_(pool), device_resident_(device_resident) {}
SavedInputs::~SavedInputs() = default;

void SavedInputs::BeginStep(int64_t num_slots) {
  num_slots_ = num_slots;
  if (static_cast<int64_t>(entries_.size()) < num_slots) entries_.resize(num_slots);
  for (auto& e : entries_) {
    if (!e) e = std::make_unique<Entry>();
    e->device = torch::Tensor();
    e->fetching = false;
    e->regenerated = false;
  }
}

bool SavedInputs::Resident(int64_t slot) const { return pool_ == nullptr || slot >= num_slots_ - device_resident_; }

void SavedInputs::Regenerated(int64_t slot) {
  TORCH_CHECK(slot >= 0 && slot < num_slots_, "slot out of range");
  entries_[slot]->regenerated = true;
}

absl::Status SavedInputs::Save(int64_t slot, const torch::Tensor& x) {
  TORCH_CHECK(slot >= 0 && slot < num_slots_, "slot out of range");
  Entry& e = *entries_[slot];
  e.sizes = x.sizes().vec();
  e.dev = x.device();
  if (Resident(slot)) {
    e.device = x;
    return absl::OkStatus();
  }
  absl::StatusOr<torch::Tensor> host = pool_->Slot(slot, x.numel(), x.scalar_type());
  if (!host.ok()) return host.status();
  e.host = host->view(x.sizes());  // (B, S, H) in the pool
  torch::Tensor src = x.contiguous();
#ifdef ODYSSEY_WITH_CUDA
  if (src.is_cuda()) {
    if (!streams_) streams_ = std::make_unique<Streams>(src.device().index());
    c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(src.device().index());
    at::cuda::CUDAEvent produced;
    produced.record(compute);
    produced.block(streams_->copy);  // the copy starts once x has been computed
    {
      c10::cuda::CUDAStreamGuard guard(streams_->copy);
      e.host.copy_(src, /*non_blocking=*/true);
    }
    // x may be freed by the caller before the copy ends: keep its block off-limits until then.
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), streams_->copy);
    e.offloaded.record(streams_->copy);
    return absl::OkStatus();
  }
#endif
  e.host.copy_(src);
  return absl::OkStatus();
}

void SavedInputs::StartFetch(int64_t slot) {
  Entry& e = *entries_[slot];
  if (e.device.defined() || e.fetching || e.regenerated) return;
#ifdef ODYSSEY_WITH_CUDA
  if (e.dev.is_cuda()) {
    c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(e.dev.index());
    // Allocated on the compute stream; the copy stream must not write before the allocation is
    // valid there, and the block must not be recycled while the copy stream still writes it.
    torch::Tensor dst = torch::empty(e.sizes, e.host.options().device(e.dev));
    at::cuda::CUDAEvent allocated;
    allocated.record(compute);
    allocated.block(streams_->copy);
    e.offloaded.block(streams_->copy);  // (same stream already; explicit for clarity)
    {
      c10::cuda::CUDAStreamGuard guard(streams_->copy);
      dst.copy_(e.host, /*non_blocking=*/true);
    }
    c10::cuda::CUDACachingAllocator::recordStream(dst.storage().data_ptr(), streams_->copy);
    e.fetched.record(streams_->copy);
    e.device = dst;
    e.fetching = true;
    return;
  }
#endif
  e.device = e.host.to(e.dev, /*non_blocking=*/false, /*copy=*/true);
}

void SavedInputs::Prefetch(int64_t slot) {
  TORCH_CHECK(slot >= 0 && slot < num_slots_, "slot out of range");
  if (!Resident(slot)) StartFetch(slot);
}

torch::Tensor SavedInputs::Take(int64_t slot, bool prefetch_below) {
  TORCH_CHECK(slot >= 0 && slot < num_slots_, "slot out of range");
  Entry& e = *entries_[slot];
  TORCH_CHECK(!e.regenerated, "slot ", slot, " kept nothing: its block regenerates its input");
  if (!e.device.defined()) StartFetch(slot);
#ifdef ODYSSEY_WITH_CUDA
  if (e.fetching) {
    e.fetched.block(c10::cuda::getCurrentCUDAStream(e.dev.index()));
    e.fetching = false;
  }
#endif
  torch::Tensor x = e.device;
  e.device = torch::Tensor();
  // Overlap the next block's host->device copy with this block's recompute.
  if (prefetch_below && slot > 0) Prefetch(slot - 1);
  return x;
}

int64_t SavedInputs::device_bytes() const {
  int64_t total = 0;
  for (int64_t i = 0; i < num_slots_ && i < static_cast<int64_t>(entries_.size()); ++i) {
    if (entries_[i] && entries_[i]->device.defined()) total += entries_[i]->device.nbytes();
  }
  return total;
}

}  // namespace odyssey::engine::memory
