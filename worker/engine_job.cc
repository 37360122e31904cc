#include "worker/engine_job.h"
#include "worker/engine_internal.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#ifdef ODYSSEY_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "common/log.h"
#include "engine/device_stats.h"
#include "engine/parallel/communicator.h"
#include "engine/parallel/rank_group.h"
#include "engine/trainer.h"
#include "model/config.h"
#include "planner/planner.h"

namespace odyssey::worker {

void SetTorchThreads(int threads) {
  if (threads > 0) torch::set_num_threads(threads);
}

namespace {

int64_t HostMemoryBytes() {
  return static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

int64_t PeakRssBytes() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

std::string CpuModelName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return absl::StrCat("CPU: ", line.substr(colon + 2));
    }
  }
  return "CPU";
}

// The GPU's name ("" on CPU).
std::string GpuName(const torch::Device& device) {
#ifdef ODYSSEY_WITH_CUDA
  cudaDeviceProp prop{};
  if (device.is_cuda() && cudaGetDeviceProperties(&prop, device.index()) == cudaSuccess) return prop.name;
#endif
  return "";
}

// Dense bf16 peak of the GPU, for MFU; 0 when unknown (no MFU reported, e.g. on CPU).
double PeakFlops(const torch::Device& device) {
  const std::string name = GpuName(device);
  if (absl::StrContains(name, "H100") || absl::StrContains(name, "H200")) return 989e12;
  if (absl::StrContains(name, "A100")) return 312e12;
  return 0;
}

// Model FLOPs of training on `tokens` positions in rows of `seq_len`: 6 per parameter per token
// (forward + backward) plus causal attention (12 * layers * hidden * S / 2 per token).
double TrainingFlops(const model::ModelConfig& c, int64_t tokens, int64_t seq_len) {
  const double per_token = 6.0 * static_cast<double>(c.NumParameters()) +
                           6.0 * c.num_hidden_layers * static_cast<double>(c.hidden_size) * seq_len;
  return per_token * static_cast<double>(tokens);
}

}  // namespace

absl::StatusOr<std::string> WriteCheckpoint(engine::Trainer& trainer, const std::string& dir, int keep,
                                            const std::string& owner) {
  // Staged beside the step folder and published by a rename: a machine crash leaves the old
  // checkpoint or the new one, never a torn one. A previous run of this job may have left the
  // same step (it died after writing it and was resumed from an older one): the new one
  // replaces it. Another owner's step is never replaced (it may have appeared after the start
  // check: a job of another controller writing here).
  const std::string final_path = CheckpointPath(dir, trainer.step());
  if (absl::Status s = CheckReplaceable(final_path, owner, "checkpoint"); !s.ok()) return s;
  absl::StatusOr<StagedFolder> staged = StagedFolder::Create(final_path);
  if (!staged.ok()) return staged.status();
  // First, so that even a staging folder left by a crash names its owner.
  if (absl::Status s = WriteOwner(staged->path(), owner); !s.ok()) return s;
  if (absl::Status s = trainer.SaveCheckpoint(staged->path()); !s.ok()) return s;
  if (absl::Status s = PublishOwned(*staged, owner, "checkpoint"); !s.ok()) return s;
  PruneCheckpoints(dir, owner, keep);
  return final_path;
}

namespace {

// Fills o->memory from the job's memory fields: on a GPU by planner::PlanModelJob, the rule the
// controller's admission and PlannerService.Plan apply (the set fields fixed, the planner's
// choice for the rest, this device's memory and the one host-budget rule; on a CPU its host
// memory, planner::CpuHardware). Either way the strategy is validated whole.
absl::Status ChooseMemory(const EngineJobOptions& j, engine::TrainerOptions* o) {
  absl::StatusOr<torch::Device> device = engine::ParseDevice(j.device);
  if (!device.ok()) return device.status();
  const int64_t host_budget = planner::HostBudget(HostMemoryBytes(), j.memory.host_budget_bytes);
  planner::Hardware hw;  // an H200's when the device does not say
  std::string dtype = j.dtype;
  if (!device->is_cuda()) {
    // A CPU rank computes in host memory (planner::CpuHardware), in float32 unless the spec says.
    hw = planner::CpuHardware(HostMemoryBytes(), j.memory.host_budget_bytes);
    if (dtype.empty() || dtype == "auto") dtype = "float32";
  } else {
    const engine::DeviceMemory mem = engine::ReadDeviceMemory(*device);
    if (mem.total > 0) hw.gpu_bytes = planner::UsableGpuBytes(mem.total);
    hw.host_bytes = host_budget;
  }
  // One rank holds seq_len / context_parallel positions (planner::RankSeqLen).
  const int64_t rank_seq = (j.seq_len + std::max(1, j.context_parallel) - 1) / std::max(1, j.context_parallel);
  // Sharded, a rank keeps 1/world_size of the parameters and their state (planner::ShardRanks).
  absl::StatusOr<model::ModelConfig> config = model::ResolveModelConfig(j.model);
  if (!config.ok()) return absl::InvalidArgumentError(absl::StrCat("spec.model.name: ", config.status().message()));
  if (absl::Status s = model::SetIndexerStage("spec.model.indexer_stage", j.indexer_stage, &*config); !s.ok()) return s;
  absl::StatusOr<planner::JobPlan> plan = planner::PlanModelJob(*config, dtype, rank_seq, j.batch_size, j.memory, hw,
                                                                j.lora, j.shard_params ? j.world_size : 1,
                                                                std::max(1, j.context_parallel),
                                                                planner::GradientsToStep(j.rl_session, j.context_parallel));
  if (!plan.ok()) return plan.status();
  if (!plan->fits)
    return absl::ResourceExhaustedError(absl::StrCat("memory: no strategy fits: ", plan->message));
  o->memory = plan->strategy;
  LogInfo(absl::StrCat("job=", j.job, " memory: ", j.memory.AllSet() ? "the spec's " : "planner chose ",
                       o->memory.Describe(), " (predicted ", hw.cpu ? "host" : "GPU", " peak ",
                       plan->prediction.gpu_peak_bytes >> 20,
                       " MiB, host ", plan->prediction.host_bytes >> 20, " MiB)"));
  return o->memory.Validate();
}

}  // namespace

absl::Status BuildTrainerOptions(const EngineJobOptions& j, engine::TrainerOptions* out) {
  engine::TrainerOptions& o = *out;
  o.model = j.model;
  o.device = j.device;
  o.dtype = j.dtype;
  o.attention = j.attention;
  o.indexer_stage = j.indexer_stage;
  o.shard_params = j.shard_params;
  o.seed = j.seed;
  o.steps = j.steps;
  o.optimizer.lr = j.lr;
  o.optimizer.beta1 = j.beta1;
  o.optimizer.beta2 = j.beta2;
  o.optimizer.eps = j.eps;
  o.optimizer.weight_decay = j.weight_decay;
  o.schedule.warmup_steps = j.warmup_steps;
  o.schedule.min_lr_ratio = j.min_lr_ratio;
  o.grad_clip = j.grad_clip;
  o.lora = j.lora;
  if (absl::Status s = ChooseMemory(j, &o); !s.ok()) return s;
  o.data.format = j.data_format;
  o.data.path = j.data_path;
  o.data.seq_len = j.seq_len;
  o.data.batch_size = j.batch_size;
  o.data.seed = j.seed;
  return absl::OkStatus();
}

std::string TracePath(const std::string& checkpoint_dir, const std::string& owner, int64_t step) {
  std::string name = owner;
  std::replace(name.begin(), name.end(), '/', '-');
  return (std::filesystem::path(checkpoint_dir) / "profile" / absl::StrFormat("%s-step-%08d.trace.json", name, step))
      .string();
}

namespace {

EngineOutcome Run(const EngineJobOptions& j, const std::function<bool(absl::Duration)>& stop,
                  const std::function<void(const EngineStep&)>& on_step) {
  EngineOutcome out;
  auto fail = [&](absl::Status s) {
    out.status = std::move(s);
    return out;
  };
  const bool writes_checkpoints = j.rank == 0 && !j.checkpoint_dir.empty();
  if (writes_checkpoints) {  // before any work: a folder that is not this job's fails the job now
    if (absl::Status s = CheckCheckpointFolder(j.checkpoint_dir, j.checkpoint_owner, "spec.checkpoint.directory");
        !s.ok())
      return fail(s);
    RemoveStagingLeftovers(j.checkpoint_dir, j.checkpoint_owner);  // of a run that died mid-write
  }
  if (j.trace_step < 0)
    return fail(absl::InvalidArgumentError(absl::StrCat("spec.profile.trace_step (", j.trace_step, ") must be >= 0")));
  const bool traces = j.rank == 0 && j.trace_step > 0;
  if (traces && j.checkpoint_dir.empty())
    return fail(absl::InvalidArgumentError(
        "spec.profile.trace_step: the trace is written into the job's checkpoint folder, and this run has none "
        "(set spec.checkpoint.directory)"));
  engine::TrainerOptions o;
  if (absl::Status s = BuildTrainerOptions(j, &o); !s.ok()) return fail(s);

  if (j.context_parallel > 1 && j.world_size % j.context_parallel != 0)
    return fail(absl::InvalidArgumentError(absl::StrCat("parallel.context_parallel (", j.context_parallel,
                                                        ") must divide parallel.world_size (", j.world_size, ")")));
  // Declared before the trainer, which uses them until it is destroyed.
  std::unique_ptr<engine::Communicator> comm, data_comm;
  if (j.world_size > 1) {
    // One group of all ranks (context parallel: every rank the same batches, its shard of each
    // row; data parallel: every rank its own batches), or data parallel over context-parallel
    // groups: rank r shares its sequences with the ranks of its group [r / P * P, ...) and sums
    // gradients with the ranks r % P, r % P + P, ...
    absl::StatusOr<torch::Device> device = engine::ParseDevice(j.device);
    if (!device.ok()) return fail(device.status());
    engine::RankGroupOptions go;
    go.rendezvous = j.rendezvous;
    go.rank = j.rank;
    go.world_size = j.world_size;
    go.device = *device;
    go.abort = [&stop] { return stop(absl::ZeroDuration()); };
    absl::StatusOr<engine::RankLayout> layout = engine::ConnectRankLayout(go, std::max(1, j.context_parallel));
    if (absl::IsCancelled(layout.status())) {
      out.stopped = true;
      return out;
    }
    if (!layout.ok()) return fail(layout.status());
    auto describe = [](const engine::RankGroup& g) {
      return absl::StrCat(engine::BackendName(g.choice.backend), " (", g.choice.reason, ")");
    };
    if (layout->context.comm && layout->data.comm) {
      LogInfo(absl::StrFormat("job=%s rank=%d/%d context group of %d over %s, data group of %d over %s", j.job, j.rank,
                              j.world_size, layout->context_parallel, describe(layout->context),
                              layout->data_parallel, describe(layout->data)));
    } else {
      LogInfo(absl::StrFormat("job=%s rank=%d/%d collectives over %s", j.job, j.rank, j.world_size,
                              describe(layout->context.comm ? layout->context : layout->data)));
    }
    comm = std::move(layout->context.comm);
    data_comm = std::move(layout->data.comm);
    o.context_parallel.group = comm.get();  // null: no context parallelism
    o.communicator = data_comm.get();       // null: one data-parallel rank
  }
  absl::StatusOr<std::unique_ptr<engine::Trainer>> created = engine::Trainer::Create(o);
  if (!created.ok()) return fail(created.status());
  engine::Trainer& t = **created;
  if (!j.resume_from.empty()) {
    if (absl::Status s = t.LoadCheckpoint(j.resume_from); !s.ok())
      return fail(absl::Status(s.code(), absl::StrCat(j.resume_field, " ", j.resume_from, ": ", s.message())));
    // Replay the data stream so the resumed run trains on what an uninterrupted one would.
    for (int64_t i = 0; i < t.step(); ++i) t.data().Next();
  }
  const auto& cfg = t.model()->config();
  std::string stage;  // the DSA layers' indexer stage, and what trains in the warm-up
  if (cfg.IsHybrid() && cfg.NumLayersOfKind('D') > 0) {
    int64_t trained = 0;
    for (const auto& p : t.model()->parameters()) trained += p.requires_grad() ? p.numel() : 0;
    stage = absl::StrFormat(", indexer stage %s, %.2fM trained", model::IndexerStageName(cfg.hybrid.indexer_stage),
                            static_cast<double>(trained) / 1e6);
  }
  LogInfo(absl::StrFormat("job=%s rank=%d/%d %s model %s (%.2fM params%s, %s on %s), memory %s, data %s, steps %d..%d",
                          j.job, j.rank, j.world_size,
                          absl::StrCat(j.context_parallel > 1 ? absl::StrCat("context_parallel=", j.context_parallel,
                                                                          j.context_parallel < j.world_size
                                                                              ? absl::StrCat(" data_parallel=", j.world_size / j.context_parallel)
                                                                              : "")
                                       : j.world_size > 1     ? std::string("data_parallel")
                                                              : std::string("alone"),
                                       o.shard_params ? absl::StrCat(" shard_params=", j.world_size) : ""),
                          o.model, static_cast<double>(cfg.NumParameters()) / 1e6, stage,
                          c10::toString(t.dtype()), t.device().str(), o.memory.Describe(), t.data().Describe(),
                          t.step(), o.steps));

  out.last_checkpoint = j.resume_from;
  engine::ResetPeakMemory(t.device());  // the peaks reported are this job's
  const double peak_flops = PeakFlops(t.device());
  while (t.step() < o.steps) {
    out.step = t.step();
    if (stop(absl::ZeroDuration())) {
      out.stopped = true;
      return out;
    }
    // spec.profile.phase_times: rank 0's step, timed phase by phase (stopped before anything
    // below can return).
    const bool timed = j.phase_times && j.rank == 0;
    const bool traced = traces && t.step() + 1 == j.trace_step;
    std::string trace;
    if (traced) {
      trace = TracePath(j.checkpoint_dir, j.checkpoint_owner, j.trace_step);
      std::error_code ec;
      std::filesystem::create_directories(std::filesystem::path(trace).parent_path(), ec);
      if (ec)
        return fail(absl::PermissionDeniedError(absl::StrCat("spec.profile.trace_step: cannot create ",
                                                             std::filesystem::path(trace).parent_path().string(),
                                                             ": ", ec.message())));
      if (absl::Status st = engine::StartProfile(t.device().is_cuda(), /*memory=*/true); !st.ok())
        return fail(absl::Status(st.code(), absl::StrCat("spec.profile.trace_step: ", st.message())));
    }
    if (timed) {
      if (absl::Status st = engine::StartPhaseTimes(t.device().is_cuda()); !st.ok()) {
        if (traced) (void)engine::StopProfile(trace);
        return fail(absl::Status(st.code(), absl::StrCat("spec.profile.phase_times: ", st.message())));
      }
    }
    engine::StepResult r = t.TrainStep();
    absl::StatusOr<std::vector<engine::PhaseTime>> phases;
    if (timed) phases = engine::StopPhaseTimes();
    absl::Status traced_status;
    if (traced) traced_status = engine::StopProfile(trace);
    if (!r.status.ok() && j.world_size > 1 && stop(j.peer_loss_grace)) {
      // Another rank left this one's collective: it stopped first (a cancel reaches the ranks at
      // slightly different steps) or died (the controller requeues the job and cancels this
      // rank). Either way this is the stop, not a failure.
      out.stopped = true;
      return out;
    }
    if (!r.status.ok())
      return fail(absl::Status(r.status.code(), absl::StrCat("step ", t.step() + 1, ": ", r.status.message())));
    out.step = r.step;
    if (!std::isfinite(r.loss)) return fail(absl::InternalError(absl::StrCat("step ", r.step, ": loss is ", r.loss)));
    if (timed && !phases.ok())
      return fail(absl::Status(phases.status().code(),
                               absl::StrCat("step ", r.step, ": spec.profile.phase_times: ", phases.status().message())));
    if (!traced_status.ok())
      return fail(absl::Status(traced_status.code(), absl::StrCat("step ", r.step, ": spec.profile.trace_step: ",
                                                                  traced_status.message())));
    EngineStep s;
    if (timed) s.phases = *std::move(phases);
    if (traced) s.trace = trace;
    s.step = r.step;
    s.loss = r.loss;
    s.grad_norm = r.grad_norm;
    s.lr = r.lr;
    s.tokens = r.tokens;
    s.seconds = r.seconds;
    s.tokens_per_second = r.tokens_per_second;
    s.gpu_memory_peak_bytes = engine::ReadDeviceMemory(t.device()).peak_allocated;
    s.host_offload_bytes = t.memory().host_pool_bytes();
    s.host_memory_peak_bytes = PeakRssBytes();
    if (peak_flops > 0 && r.seconds > 0)
      s.mfu = TrainingFlops(cfg, r.tokens, o.data.seq_len) / (r.seconds * peak_flops * j.world_size);
    const bool checkpoint_step =
        !j.checkpoint_dir.empty() && ((j.every_steps > 0 && r.step % j.every_steps == 0) || r.step == o.steps);
    if (writes_checkpoints && checkpoint_step) {
      absl::StatusOr<std::string> path = WriteCheckpoint(t, j.checkpoint_dir, j.keep, j.checkpoint_owner);
      if (!path.ok()) return fail(path.status());
      out.last_checkpoint = s.checkpoint = *path;
    } else if (checkpoint_step && j.shard_params) {
      // Sharded: the other ranks join rank 0's gather of the whole weights and state (they write
      // nothing; a rank 0 that failed before it leaves their collective, which then fails).
      if (absl::Status saved = t.SaveCheckpoint(""); !saved.ok())
        return fail(absl::Status(saved.code(), absl::StrCat("checkpoint at step ", r.step, ": ", saved.message())));
    }
    on_step(s);
  }
  out.step = t.step();
  return out;
}

}  // namespace

bool RanksDidNotMeet(const absl::Status& status) { return engine::RanksDidNotMeet(status); }

EngineOutcome RunEngineJob(const EngineJobOptions& options, const std::function<bool(absl::Duration)>& stop,
                           const std::function<void(const EngineStep&)>& on_step) {
  try {
    return Run(options, stop, on_step);
  } catch (const std::exception& e) {  // a libtorch error (e.g. out of memory) must not kill the worker
    EngineOutcome out;
    out.status = absl::InternalError(absl::StrCat("engine error: ", e.what()));
    return out;
  }
}

absl::StatusOr<DeviceInfo> ProbeDevice(const std::string& device) {
  absl::StatusOr<torch::Device> d = engine::ParseDevice(device);
  if (!d.ok()) return d.status();
  DeviceInfo info;
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  info.hostname = host;
  info.device = d->str();
  info.host_memory_bytes = HostMemoryBytes();
  if (d->is_cuda()) {
    info.device_name = GpuName(*d);
    info.device_memory_bytes = engine::ReadDeviceMemory(*d).total;
    return info;
  }
  info.device_name = CpuModelName();
  info.device_memory_bytes = info.host_memory_bytes;  // a CPU worker computes in host memory
  return info;
}

}  // namespace odyssey::worker
