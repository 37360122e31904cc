// EngineJob: the engine half of running one rank of an SFT job, behind a header that includes
// neither libtorch nor protobuf.
//
// Why the split: the torch wheel ships its own (old) google/protobuf headers in its include
// folder, which shadow the system protobuf that the generated odyssey.v1 code needs, and gRPC
// adds -pthread, which invalidates the shared torch precompiled header. So translation units
// that include libtorch (engine_job.cc) never include proto headers, and those that include
// proto/gRPC (job_runner.cc, worker.cc, worker_main.cc) never include libtorch.
//
// RunEngineJob, in order:
//   0. Picks the memory strategy: fields the spec leaves unset are the planner's choice on a
//      GPU (planner::Choose for the model, sequence length and this device's memory).
//   1. For world_size > 1, joins the job's ranks at `rendezvous` (rank 0 hosts it) through
//      engine::ConnectRanks, which moves the collectives to NCCL when every rank holds a GPU of
//      its own and keeps the TCP star otherwise (the log line says which and why), and trains
//      data parallel, or, with context_parallel = world_size,
//      context parallel (every rank on the same batches, S / world_size positions each;
//      engine/parallel/context_parallel.h). With 1 < context_parallel < world_size the ranks
//      are world_size / context_parallel data-parallel replicas of context-parallel groups of
//      consecutive ranks (engine::ConnectRankLayout: each group picks its own backend).
//   2. Resumes from `resume_from` when set: weights, optimizer state and step counter, then
//      replays the data stream up to that step, so a resumed run sees the batches an
//      uninterrupted run would have seen.
//   3. Steps until `steps`, asking stop(0) between steps. Rank 0 writes a checkpoint every
//      `every_steps` steps and at the end: into a hidden temp folder, fsynced, then renamed to
//      <checkpoint_dir>/step-NNNNNNNN (readers never see a half-written one); only the newest
//      `keep` of its own are kept (0 = all). Before all of this (step 0), rank 0 refuses a
//      checkpoint_dir holding another owner's step folders (checkpoint_folder.h), so such a job
//      fails at its start, not after training.
//   When a step's collective fails (another rank's process died), the run waits up to
//   peer_loss_grace for a stop before it reports a failure: the controller, which sees the dead
//   worker, requeues the job and cancels the surviving ranks, so the job restarts from its last
//   checkpoint instead of failing on the survivor's error.
// Thread safety: RunEngineJob runs on the calling thread; `stop` is called from it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/profiler.h"
#include "model/config.h"
#include "planner/memory_strategy.h"
#include "worker/checkpoint_folder.h"

namespace odyssey::worker {

struct EngineJobOptions {
  std::string job;  // "jobs/{id}", for log lines
  // What to train (TrainerOptions' meaning; see engine/trainer.h).
  std::string model = "tiny";
  std::string device = "auto";
  std::string dtype = "auto";
  std::string attention = "auto";
  std::string indexer_stage;  // JobSpec model.indexer_stage: "" = the model's (engine::TrainerOptions)
  bool rl_session = false;    // an RL session's trainer (RlSession::Create sets it): its plan keeps every gradient
  int64_t steps = 0;
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0, min_lr_ratio = 0;
  int64_t warmup_steps = 0;
  double grad_clip = 0;  // <= 0 disables
  // Memory strategy (JobSpec.memory, converted by planner::MemoryFieldsFromProto). Unset fields
  // are the planner's choice on a GPU (planner::PlanModelJob: the fastest strategy that fits the
  // device and host memory with the set fields fixed); on a CPU unset means off.
  planner::MemoryFields memory;
  // JobSpec.lora (planner::LoraFromProto); rank 0 = full fine-tuning.
  model::LoraConfig lora;
  std::string data_format = "kjv";
  std::string data_path;
  int64_t seq_len = 256;
  int64_t batch_size = 1;
  uint64_t seed = 0;  // model init and data sampling
  // Where this rank stands.
  int rank = 0;
  int world_size = 1;
  // Ranks sharing each sequence (parallel.context_parallel; 0 or 1 = none); divides world_size.
  int context_parallel = 1;
  // ZeRO-3 sharding of parameters, gradients and optimizer state over all world_size ranks
  // (parallel.shard_params; engine/parallel/sharding.h). Checkpoints are then gathered by every
  // rank together (rank 0 writes them).
  bool shard_params = false;
  std::string rendezvous;      // host:port, for world_size > 1
  std::string resume_from;     // checkpoint folder; empty = fresh
  std::string resume_field = "resume_from";  // what errors of the resume call it
  std::string checkpoint_dir;  // empty = no checkpoints
  // Who the step folders rank 0 writes belong to (checkpoint_folder.h); never empty when
  // checkpoint_dir is set (JobRunner falls back to `job`).
  std::string checkpoint_owner;
  int64_t every_steps = 0;     // 0 = only at the end
  int keep = 0;                // 0 = all
  // How long a rank whose collective failed waits for a stop before failing the job (longer
  // than the controller's time to declare a silent worker dead).
  absl::Duration peer_loss_grace = absl::Seconds(30);
  // spec.profile.phase_times: rank 0 times each step's phases (engine/profiler.h) into its
  // EngineStep.
  bool phase_times = false;
  // spec.profile.trace_step: rank 0 records this step (1-based; 0 = none) with the profiler into
  // TracePath(checkpoint_dir, checkpoint_owner, step), which needs a checkpoint_dir.
  int64_t trace_step = 0;
};

// Where rank 0 writes the Chrome trace of `step`: <checkpoint_dir>/profile/<owner with '/' as
// '-'>-step-NNNNNNNN.trace.json.
std::string TracePath(const std::string& checkpoint_dir, const std::string& owner, int64_t step);

// What one step did (rank-wide figures sum over the ranks).
struct EngineStep {
  int64_t step = 0;
  double loss = 0, grad_norm = 0, lr = 0;
  int64_t tokens = 0;  // positions of all ranks
  double seconds = 0, tokens_per_second = 0;
  int64_t gpu_memory_peak_bytes = 0;
  int64_t host_offload_bytes = 0;  // the job's pinned host pool
  int64_t host_memory_peak_bytes = 0;
  double mfu = 0;  // 0 where the device's peak is unknown (CPU)
  std::string checkpoint;  // written at this step, if any
  std::vector<engine::PhaseTime> phases;  // with phase_times, on rank 0: longest first
  std::string trace;                      // the Chrome trace written of this step, if any
};

struct EngineOutcome {
  absl::Status status;   // not OK: the run failed (the message says at which step and why)
  bool stopped = false;  // stop() ended it
  int64_t step = 0;      // steps completed
  std::string last_checkpoint;
};

// Whether a run's (SFT or RL session) failure was its ranks not meeting at the rendezvous
// (engine::RanksDidNotMeet: the port taken, a rank late or gone while they met); nothing of the
// job ran, and another attempt may succeed.
bool RanksDidNotMeet(const absl::Status& status);

// stop(wait): whether the run should stop, waiting up to `wait` for that to become true.
EngineOutcome RunEngineJob(const EngineJobOptions& options, const std::function<bool(absl::Duration wait)>& stop,
                           const std::function<void(const EngineStep&)>& on_step);

struct DeviceInfo {
  std::string hostname;
  std::string device;  // "cpu" or "cuda:N"
  std::string device_name;
  int64_t device_memory_bytes = 0;
  int64_t host_memory_bytes = 0;
};
// What this machine offers for `device` (auto | cpu | cuda | cuda:N). Errors name the rule.
absl::StatusOr<DeviceInfo> ProbeDevice(const std::string& device);

// torch::set_num_threads, for callers that do not include libtorch.
void SetTorchThreads(int threads);


}  // namespace odyssey::worker
