// HostAdamW: AdamW whose fp32 master weights and moments live in host memory and whose update
// runs on CPU threads (planner::MemoryStrategy::optimizer_on_host; AdamW delegates to it when
// states_on_host). The GPU then holds no fp32 optimizer state, only the bf16 params and grads.
//
// The update is the kernel of engine/host_adamw_kernel.h (the device path's math, op for op).
//
// On CUDA parameters the update is a pipeline (ZeRO-Offload's idea, DESIGN.md section 4.5):
//   backward ── GradsReady(i) ──► grad i goes device→host on a copy stream (after an event on
//                                  the compute stream) into a pinned staging buffer
//   Step(lr)  ──► sends the gradients not yet sent; worker threads take the parameters in order
//                 (the next forward's: embedding, layer 0 .. L-1, final norm, head), wait for
//                 each one's gradient to land, update its master and moments, round it into
//                 the staging buffer (over the gradient) and upload it on a second copy stream,
//                 recording an event; Step returns at once
//   forward   ── WaitParams(i) ──► blocks the host until i's upload is enqueued, then makes the
//                                  current (compute) stream wait for its event: no host sync
// so the next forward overlaps the update of the layers it has not reached yet. The clip is a
// factor the workers apply (grad_scale): the global norm is computed on the device
// (GradClipScale in optimizer.h, one multi-tensor read of the bf16 grads there; AdamW::Step reads
// the factor once) since the host copies may still be in flight.
// Pinned staging: one buffer per parameter in the param's dtype (2 bytes per parameter in bf16),
// allocated once: the gradient lands there and the rounded bf16 update replaces it in place for
// the upload (the next gradient copy waits for that upload on its stream). The states are
// pageable host memory (they never cross PCIe): 12 bytes a parameter (fp32 master, exp_avg,
// exp_avg_sq), 8 with bf16_moments.
//
// On a CPU device the same kernel runs in place (reading .grad(), writing the rounded bf16 into
// the parameter) on the same worker threads, and Step returns when it is done.
//
// Thread safety: one training thread calls everything, except GradsReady, which autograd may call
// from its device thread while the training thread waits inside backward(). The worker threads
// are internal. Invariants: a parameter is "busy" from Step until its upload is enqueued (CPU:
// written); while busy nothing reads or writes its staging buffers but its worker, and
// GradsReady, WaitParams and Finish wait for it first.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/types.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "engine/host_adamw_kernel.h"
#include "engine/memory/host_pool.h"

namespace odyssey::engine {

// The one decoupled-weight-decay rule: matrices (2+ dims) decay; norms' weights and biases
// (1-D) do not, as in Hugging Face's and torchtitan's recipes.
inline bool DecaysWeights(const torch::Tensor& param) { return param.dim() >= 2; }

struct HostOptimizerOptions {
  // Worker threads; 0 = std::thread::hardware_concurrency() - 1 (the training thread keeps a
  // core), at least 1.
  int threads = 0;
  // Elements a worker updates at a time (> 0): big parameters (the embedding) are split across
  // the threads; ~7 MB of state traffic per chunk.
  int64_t chunk_elements = int64_t{1} << 18;
  // CPU parameters only, for tests: behave like the CUDA pipeline at its laziest. GradsReady
  // copies the gradient into a host staging buffer (the device→host copy) and a parameter is
  // updated only when WaitParams or Finish asks for it, so a read of a parameter that does not
  // wait first sees the old value and a gradient staged before it is final gives a wrong update.
  bool deferred_cpu = false;
  // Keep exp_avg and exp_avg_sq in bf16 (DeepSeek-V3's recipe, which also keeps fp32 master
  // weights): 8 bytes of host state a parameter instead of 12 (fp32 master 4, moments 2 + 2),
  // 13.4 GiB less for a 3.6B-parameter model. Each moment is computed in fp32 exactly as without
  // it, from the stored moment widened to fp32, and rounded to bf16 (nearest even, Bf16Bits) when
  // stored; the step's own update reads the fp32 moments before that rounding, and the master
  // stays fp32 (HostAdamWUpdateBf16Moments). Checkpoints hold fp32 moments either way
  // (AdamW::StateTensors). false: fp32 moments.
  bool bf16_moments = false;
};

class HostAdamW {
 public:
  // Views of one parameter's host state in the parameter's shape, in the dtype it is stored in:
  // `master` fp32; the moments fp32, or bf16 with bf16_moments (a write through them is a write
  // of the state). An fp32 CPU parameter is its own master (`master` aliases it).
  struct State {
    torch::Tensor master, exp_avg, exp_avg_sq;
  };

  // REQUIRES: every param on one device, contiguous, fp32 or bf16 (TORCH_CHECK).
  HostAdamW(std::vector<torch::Tensor> params, const HostOptimizerOptions& options);
  ~HostAdamW();  // finishes the update in flight and joins the workers
  HostAdamW(const HostAdamW&) = delete;
  HostAdamW& operator=(const HostAdamW&) = delete;

  // Final state after Finish(); live views (the next Step changes them).
  State state(size_t i) const;
  // The gradients of params[i] for i in `indices` are final for this step: start copying them
  // to the host (CUDA; deferred_cpu: copy now). Parameters without a gradient, or already sent
  // this step, are skipped. Waits for the previous update of those params first.
  void GradsReady(const std::vector<int64_t>& indices);
  // The gradients of params[i] for i in `indices` were sent (GradsReady) and nothing on the
  // device reads them again this step: their squared L2 norms are added (fp32, on the device,
  // queued on the current stream) to ReleasedGradSquares() and the device tensors are dropped, so
  // a layer's gradients leave the GPU with its backward rather than at the step (a full-depth
  // 3B model's bf16 gradients are 6 GB). Step updates them from what was sent. CUDA and
  // deferred_cpu only (the CPU update reads .grad() itself); params not sent are skipped.
  void ReleaseGrads(const std::vector<int64_t>& indices);
  // The sum of the squared norms of the gradients released this step (undefined when none was).
  torch::Tensor ReleasedGradSquares() const;
  // Updates every parameter that has a gradient (sending those not sent yet) with `step`'s
  // hyperparameters; returns at once on CUDA (CPU: when done). Waits for the previous update.
  void Step(const AdamWStep& step);
  // Before params[i] is read: waits for its update and (CUDA) makes the current stream wait for
  // its upload. Throws (c10::Error) if a worker failed.
  void WaitParams(const std::vector<int64_t>& indices);
  // WaitParams for every parameter.
  void Finish();
  // The step's gradients were dropped (ZeroGrad): nothing counts as sent or released any more.
  void DropGrads();
  int threads() const { return static_cast<int>(workers_.size()); }
  // Host bytes of the states (masters and moments, the pageable pool), not counting an fp32 CPU
  // parameter's master (the parameter itself) or the staging buffers: 12 per parameter, 8 with
  // bf16_moments.
  int64_t state_bytes() const { return states_->allocated_bytes(); }

 private:
  struct Param;
  struct Cuda;
  struct Chunk {
    int64_t param = 0, begin = 0, end = 0;
  };
  static bool NotBusy(Param* p);
  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies the gradient of params_[i] to its staging buffer (CUDA: enqueues it).
  void SendLocked(int64_t i, bool& recorded) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until params_[i] is not busy (deferred_cpu: runs its update here).
  void AwaitParamLocked(int64_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Update(const Param& p, int64_t begin, int64_t end) const;
  // After the last chunk of params_[i]: the upload (CUDA) and the end of busy.
  void Publish(int64_t i);
  void WorkerLoop();

  HostOptimizerOptions options_;
  bool cuda_ = false;
  std::vector<std::unique_ptr<Param>> params_;
  std::unique_ptr<memory::HostPool> states_;   // master and moments: pageable
  std::unique_ptr<memory::HostPool> staging_;  // grads and bf16 params in transit: pinned on CUDA
  std::unique_ptr<Cuda> cuda_state_;           // streams (CUDA builds with CUDA params)
  mutable absl::Mutex mu_;
  std::vector<Chunk> chunks_ ABSL_GUARDED_BY(mu_);  // this step's work, in parameter order
  size_t next_chunk_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t busy_ ABSL_GUARDED_BY(mu_) = 0;      // parameters not yet published this step
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  torch::Tensor released_sq_ ABSL_GUARDED_BY(mu_);  // ReleasedGradSquares()
  std::string error_ ABSL_GUARDED_BY(mu_);     // the first worker failure (CUDA calls)
  std::vector<std::thread> workers_;
};

}  // namespace odyssey::engine
