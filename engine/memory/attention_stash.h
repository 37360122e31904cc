// Keeping each layer's attention output and log-sum-exp from the first forward, so that the
// layer's recompute in backward runs the attention backward kernel without the attention
// forward again. Under full-layer recompute attention runs forward twice; this removes one,
// lifting the MFU ceiling at long S (attention-bound) from ~38% to ~45% for a 3B model, at the
// price of one (S, Hq*D) bf16 tensor + (Hq, S) fp32 per layer held until backward.
//
// AttentionStash is the per-step record; StashingAttention is an AttentionBackend that wraps
// a kernel backend (which must expose CausalWithStats / CausalBackward) and, as the memory
// stack's runner directs per layer, either computes and records (first forward), replays
// (recompute: returns the recorded output; its backward calls the kernel's backward), or
// passes through. Head groups wrap the stashing backend, so each group is one record.
// Thread safety: one thread at a time (the training thread).
#pragma once

#include <memory>
#include <vector>

#include "kernels/attention.h"

namespace odyssey::engine::memory {

class AttentionStash {
 public:
  enum class Mode { kOff, kRecord, kReplay };
  struct Entry {
    torch::Tensor out;  // (B, Hq, S, D)
    kernels::AttentionStats stats;
  };

  // Sets what the next attention calls do for decoder layer `layer`; resets the call cursor.
  void Begin(int64_t layer, Mode mode);
  void End() { mode_ = Mode::kOff; }
  Mode mode() const { return mode_; }
  void Record(Entry entry);
  // The next recorded entry of the current layer (each replayed once, then released).
  Entry Replay();
  // Bytes held by records now.
  int64_t bytes() const;
  // Releases every record: at the start of each step's forward and when gradients are dropped,
  // so that what a failed step recorded (up to ~10 GiB at long S) never lives into the next.
  void Clear();

 private:
  Mode mode_ = Mode::kOff;
  int64_t layer_ = 0;
  size_t cursor_ = 0;
  std::vector<std::vector<Entry>> layers_;
};

class StashingAttention final : public kernels::AttentionBackend {
 public:
  StashingAttention(std::shared_ptr<const kernels::AttentionBackend> inner, AttentionStash* stash)
      : inner_(std::move(inner)), stash_(stash) {}
  std::string name() const override { return inner_->name() + "+kept-outputs"; }
  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override;

 private:
  std::shared_ptr<const kernels::AttentionBackend> inner_;
  AttentionStash* stash_;  // owned by the MemoryStack
};

}  // namespace odyssey::engine::memory
