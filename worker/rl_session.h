// RlSession: the engine half of an RL_SESSION job on its worker — one Trainer serving
// TrainingService calls — behind a header that includes neither libtorch nor protobuf (the
// reason is in engine_job.h). The proto side (rl_calls.h) converts TrainingCall <-> RlRequest /
// RlResponse, filling the batch's engine::Datum structs (engine/rl_datum.h, torch-free) once:
// the engine reads them as they are, and validates them once (Trainer::ValidateRl). JobRunner
// owns the FIFO of calls, the idle timeout and the cancel.
//
// Create() builds the Trainer exactly as an SFT run does (BuildTrainerOptions: the same
// model, device, dtype, memory strategy / planner choice; data.seq_len x data.batch_size is the
// per-call batch the memory was planned for) and resumes from `resume_from` when set (weights,
// optimizer state, step counter).
//
// Several ranks (world_size > 1, data parallel): like an SFT data-parallel run, Create joins the
// rendezvous at options.rendezvous (rank 0 hosts it; engine::ConnectRanks: NCCL when every rank
// holds a GPU of its own, the TCP star otherwise) and the Trainer broadcasts
// rank 0's weights; every rank resumes from the same `resume_from`. The controller sends each
// rank its slice of every forward_backward / forward (RlRequest::weight_sum, datum_offset) and
// every optim_step / load_checkpoint, in the same order on every rank: the engine's collectives
// (inside ForwardBackward and OptimStep) pair up the ranks' calls by their order. With
// context_parallel = world_size the ranks are one context-parallel group instead: the
// controller sends every rank the whole batch, each runs its positions of every row
// (engine/trainer.h) and returns the whole batch's logprobs and loss. With 1 < context_parallel
// < world_size, world_size / context_parallel such groups of consecutive ranks are data
// parallel (engine::ConnectRankLayout), each group getting one slice.
//
// Run() executes one call. Errors come back in RlResponse::status with the engine's codes and
// messages unchanged (INVALID_ARGUMENT naming batch[i].field[j] and the rule for bad batches;
// FAILED_PRECONDITION for optim_step without gradients; UNIMPLEMENTED for sample under context
// parallelism (decoding runs on whole rows); RESOURCE_EXHAUSTED out of memory;
// INTERNAL otherwise); a libtorch exception never escapes. Checkpoints and exports are written
// atomically: into a hidden temp folder beside the target, fsynced, then renamed; they carry the
// session's owner file and replace only an empty folder or the session's own
// (checkpoint_folder.h), and Create refuses a checkpoint_dir holding another job's steps. A
// load_checkpoint folder is checked before anything is loaded (NOT_FOUND when missing,
// FAILED_PRECONDITION when it is not a checkpoint of this model: files, tensor names, shapes),
// so a wrong folder leaves the session as it was; the load drops pending gradients.
// Thread safety: one thread at a time (the session's run thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/rl_datum.h"
#include "engine/sampling.h"
#include "worker/engine_job.h"

namespace odyssey::worker {

enum class RlMethod {
  kForwardBackward,
  kOptimStep,
  kForward,
  kSaveCheckpoint,
  kLoadCheckpoint,
  kExportWeights,
  kSample,
};

// One TrainingService call, with the proto's defaults still unapplied (0 = default).
struct RlRequest {
  RlMethod method = RlMethod::kForward;
  std::vector<engine::Datum> batch;  // forward_backward, forward (empty arrays are absent)
  // forward_backward: "cross_entropy" | "importance_sampling" | "ppo"; clip 0 = 0.2.
  std::string loss_kind;
  double clip_low = 0, clip_high = 0;
  // optim_step: AdamW; betas 0/0 = 0.9/0.95, eps 0 = 1e-8.
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  // save_checkpoint (empty = <checkpoint_dir>/step-N), load_checkpoint, export_weights.
  std::string directory;
  std::string dtype;  // export_weights: "" = the session's dtype | float32 | bfloat16
  // A multi-rank session's slice (engine RlShard): forward_backward: W of the whole batch (0 = the
  // slice's own, single rank); forward_backward, forward: whole-batch index of batch[0].
  double weight_sum = 0;
  int64_t datum_offset = 0;
  // sample: the prompts and parameters (defaults applied: num_samples 0 = 1, temperature unset =
  // 1, top_p 0 = 1); validated by the engine (engine/sampler.h). draw_seed: the request set no
  // seed, so the session draws one (returned in RlResponse::seed).
  engine::SampleSpec sample;
  bool draw_seed = false;
};

struct RlResponse {
  absl::Status status;
  // forward_backward, forward: per datum, the logprob of each target token.
  std::vector<std::vector<float>> logprobs;
  // forward_backward.
  double loss = 0, weight_sum = 0, mismatch_mean = 0, mismatch_max = 0;
  int64_t mismatch_tokens = 0, clipped_tokens = 0, tokens = 0;
  double seconds = 0;
  // optim_step, save_checkpoint, load_checkpoint: optimizer steps completed.
  int64_t step = 0;
  double grad_norm = 0, lr = 0;  // optim_step
  std::string directory;         // save_checkpoint, export_weights: what was written
  engine::SampleResult sample;   // sample
  uint64_t seed = 0;             // sample: the seed used
  // Every call: the device's peak allocated bytes during it (0 on CPU), and the pinned host
  // bytes the memory strategy holds (offloaded layer inputs, host optimizer state).
  int64_t gpu_memory_peak_bytes = 0;
  int64_t host_offload_bytes = 0;
  // forward_backward, optim_step with the session's phase_times, on rank 0: the call's phase
  // times (engine/profiler.h), longest first.
  std::vector<engine::PhaseTime> phases;
};

class RlSession {
 public:
  // `abort` (may be empty) is asked while a multi-rank session waits for its peers at the
  // rendezvous: true gives up with CANCELLED (the job was cancelled meanwhile).
  static absl::StatusOr<std::unique_ptr<RlSession>> Create(const EngineJobOptions& options,
                                                           const std::function<bool()>& abort = nullptr);
  ~RlSession();
  RlSession(const RlSession&) = delete;
  RlSession& operator=(const RlSession&) = delete;

  // Executes one call.
  RlResponse Run(const RlRequest& request);
  int64_t step() const;
  // "model tiny (0.86M params, float32 on cpu), memory ..." for logs.
  std::string Describe() const;

 private:
  struct Impl;
  explicit RlSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace odyssey::worker
