// AdamW with fp32 master weights and moments over (possibly bf16) parameters, the learning-
// rate schedule (linear warmup + cosine decay) and global gradient-norm clipping.
//
// A parameter in fp32 is its own master; a bf16/fp16 one gets an fp32 master copy, updated in
// fp32 and copied back (rounded) into the parameter after each step, so small updates are not
// lost to bf16 rounding. Moments are fp32 (bf16 on the host with HostOptimizerOptions::
// bf16_moments; checkpoints hold fp32 either way). The update is torch.optim.AdamW's (decoupled
// weight decay, bias correction), with decay applied only to parameters of 2+ dimensions.
// With states_on_host the state lives in host memory and the update runs on CPU threads
// (HostAdamW, engine/host_adamw.h): on CUDA it overlaps the next forward, so whatever reads the
// parameters between Step and the next Step must wait for them (WaitParams / Finish; the
// trainer does).
// Thread safety: one thread at a time (GradsReady: see HostAdamW).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "engine/host_adamw.h"

namespace odyssey::engine {

struct AdamWOptions {
  double lr = 3e-4;            // peak learning rate (> 0)
  double beta1 = 0.9;          // in [0, 1)
  double beta2 = 0.95;         // in [0, 1)
  double eps = 1e-8;           // > 0
  double weight_decay = 0.1;   // >= 0; 0 disables; never applied to 1-D params (norms, biases)
  absl::Status Validate() const;
};

struct ScheduleOptions {
  int64_t warmup_steps = 0;    // linear warmup from lr/warmup to lr; 0 = none
  int64_t total_steps = 0;     // cosine decay ends here; 0 = constant lr after warmup
  double min_lr_ratio = 0.1;   // final lr = min_lr_ratio * lr, in [0, 1]
  absl::Status Validate() const;
};

// Learning rate for the step that follows `completed_steps` steps.
double ScheduledLr(double peak_lr, int64_t completed_steps, const ScheduleOptions& schedule);

// Scales every gradient so that their global L2 norm is at most max_norm (<= 0: no clipping).
// Returns the norm before clipping. Parameters without a gradient are skipped.
double ClipGradNorm(const std::vector<torch::Tensor>& params, double max_norm);
// The global L2 norm of the gradients (fp32 per parameter, on their device; one host sync);
// 0 when none has one.
double GradNorm(const std::vector<torch::Tensor>& params);
// The factor ClipGradNorm multiplies the gradients by: max_norm / (norm + 1e-6) when
// max_norm > 0 and norm > max_norm, else exactly 1.
double ClipScale(double norm, double max_norm);

// The same without touching the gradients or waiting for the device: the global L2 norm (an
// fp32 scalar tensor on the gradients' device; 0 on the CPU when none has a gradient) and the
// factor that clips it, min(1, max_norm / (norm + 1e-6)) (undefined when max_norm <= 0), for
// AdamW::Step to multiply into each gradient as it reads it. One multi-tensor norm, no host sync.
// released_squares: the squared norms of gradients no longer on the device
// (AdamW::ReleasedGradSquares), counted in the norm.
struct GradClip {
  torch::Tensor norm;
  torch::Tensor scale;
};
GradClip GradClipScale(const std::vector<torch::Tensor>& params, double max_norm,
                       const torch::Tensor& released_squares = torch::Tensor());

class AdamW {
 public:
  // states_on_host (planner::MemoryStrategy::optimizer_on_host): keep the fp32 master weights
  // and both moments in host memory, 12 bytes per parameter off the GPU, and run the update on
  // CPU threads (HostAdamW, configured by `host`): only the bf16 gradients go to the host and the
  // bf16 parameters come back (about 4 bytes per parameter over PCIe per step, through one pinned
  // 2-byte staging buffer per parameter), overlapped with backward (GradsReady) and with the next
  // forward (WaitParams). host.bf16_moments: 8 bytes per parameter on the host instead of 12
  // (engine/host_adamw.h). Fixed for the optimizer's life.
  // REQUIRES (states_on_host): the params are fp32 or bf16, contiguous, on one device.
  // REQUIRES: !host.bf16_moments unless states_on_host (TORCH_CHECK: the device path keeps fp32
  // moments only).
  AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, const AdamWOptions& options,
        bool states_on_host = false, const HostOptimizerOptions& host = {});

  // One update with learning rate `lr` from the parameters' .grad() times grad_scale (an fp32
  // scalar tensor on the parameters' device, e.g. GradClip::scale; undefined = 1); params without
  // a grad are skipped (their state does not advance). On the device, one fused kernel per
  // parameter (kernels::AdamWUpdate) where the kernels are built, and the host does not wait; on
  // the host (states_on_host) the workers apply the factor, read once as a number (their update
  // needs the whole backward first anyway). states_on_host with CUDA params: returns before the
  // update is done (see WaitParams).
  void Step(double lr, const torch::Tensor& grad_scale = torch::Tensor());
  // The same with the factor as a number (e.g. ClipScale(GradNorm(params), max_norm)).
  void Step(double lr, double grad_scale);
  // Drops the gradients (and, on the host, whatever GradsReady sent of them).
  void ZeroGrad();
  // Host state only (no-ops otherwise), indices into named_params. GradsReady: these params'
  // gradients are final for this step (no later backward or all-reduce changes them): start
  // copying them to the host. WaitParams: these params are about to be read (a layer's
  // forward): wait for their update. Finish: WaitParams for all; anything that reads or writes
  // the parameters or the state outside a forward (checkpoints, eval, export) calls it first.
  void GradsReady(const std::vector<int64_t>& indices);
  // Host state only: after GradsReady, drops those params' device gradients (HostAdamW::
  // ReleaseGrads); ReleasedGradSquares: their squared norms' sum for the clip (GradClipScale's
  // released_squares), undefined when none was released.
  void ReleaseGrads(const std::vector<int64_t>& indices);
  torch::Tensor ReleasedGradSquares() const;
  void WaitParams(const std::vector<int64_t>& indices);
  void Finish();
  int64_t steps() const { return steps_; }
  const AdamWOptions& options() const { return options_; }
  // Replaces beta1, beta2, eps, weight_decay and lr for the following steps (RL sessions send
  // them with every optim_step).
  // REQUIRES: options.Validate() is OK.
  void set_hyperparameters(const AdamWOptions& options) { options_ = options; }
  bool states_on_host() const { return host_ != nullptr; }

  // Optimizer state by name for checkpoints: "exp_avg.<param>", "exp_avg_sq.<param>",
  // "master.<param>" (only for non-fp32 params), "step" (int64 scalar). Waits for an update in
  // flight (host state); the tensors are live views of the state, except bf16 moments
  // (bf16_moments), which come as fp32 copies: a checkpoint has one format whatever the setting.
  std::vector<std::pair<std::string, torch::Tensor>> StateTensors() const;
  // Restores what StateTensors() returned; errors name the missing or mismatched tensor. fp32
  // moments loaded into bf16 ones are rounded to nearest even (so either setting loads either's).
  absl::Status LoadStateTensors(const std::vector<std::pair<std::string, torch::Tensor>>& tensors);

 private:
  struct Slot {
    std::string name;
    torch::Tensor param;
    torch::Tensor master;  // fp32; same storage as param when param is fp32 (on the device)
    torch::Tensor exp_avg, exp_avg_sq;  // param's shape; fp32 (bf16 with host bf16_moments)
    bool decay = false;
    bool on_host = false;  // master and moments are host_'s (views)
  };
  AdamWOptions options_;
  std::unique_ptr<HostAdamW> host_;  // states_on_host: owns the state and runs the update
  std::vector<Slot> slots_;
  int64_t steps_ = 0;
};

}  // namespace odyssey::engine
