#include "worker/rl_session.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <random>
#include <utility>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/log.h"
#include "engine/device_stats.h"
#include "engine/parallel/communicator.h"
#include "engine/parallel/rank_group.h"
#include "engine/rl_loss.h"
#include "engine/sampler.h"
#include "engine/trainer.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "worker/engine_internal.h"

namespace odyssey::worker {
namespace fs = std::filesystem;

namespace {

// Writes a folder with `write(staging)` into a StagedFolder beside `dir` (common/files.h) and
// publishes it onto `dir`: readers see the old folder or the complete new one. The folder names
// `owner` (checkpoint_folder.h). An existing `dir` is replaced only when it is empty or
// `owner`'s (an earlier checkpoint or export of this session): anything else is somebody's data,
// FAILED_PRECONDITION naming `field`.
absl::StatusOr<std::string> WriteFolderAtomically(const std::string& dir, const char* field, const std::string& owner,
                                                  const std::function<absl::Status(const std::string&)>& write) {
  fs::path target = fs::path(dir).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();  // a trailing slash
  const fs::path parent = target.parent_path();
  std::error_code ec;
  if (absl::Status s = CheckReplaceable(target.string(), owner, field); !s.ok()) return s;
  fs::create_directories(parent, ec);
  // The client chose the path: one the worker cannot create (under a regular file, on a
  // read-only or virtual file system, no permission) is the request's problem, not ours.
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": cannot create \"", parent.string(), "\" on the session's worker: ", ec.message()));
  }
  // Not creating the staging folder there is the same problem as not creating the parent.
  absl::StatusOr<StagedFolder> staged = StagedFolder::Create(target.string());
  if (!staged.ok()) return absl::FailedPreconditionError(absl::StrCat(field, ": ", staged.status().message()));
  if (absl::Status s = WriteOwner(staged->path(), owner); !s.ok())
    return absl::Status(s.code(), absl::StrCat(field, " \"", target.string(), "\": ", s.message()));
  if (absl::Status s = write(staged->path()); !s.ok())
    return absl::Status(s.code(), absl::StrCat(field, " \"", target.string(), "\": ", s.message()));
  if (absl::Status s = PublishOwned(*staged, owner, field); !s.ok())
    return absl::IsAborted(s) ? s : absl::InternalError(absl::StrCat(field, ": ", s.message()));
  return target.string();
}

}  // namespace

struct RlSession::Impl {
  EngineJobOptions options;
  engine::TrainerOptions trainer_options;
  // world_size > 1: the ranks' groups (context-parallel, data-parallel; either may be null);
  // declared before the trainer, which uses them until destroyed.
  std::unique_ptr<engine::Communicator> comm, data_comm;
  std::unique_ptr<engine::Trainer> trainer;

  engine::RlShard Shard(const RlRequest& req) const {
    engine::RlShard shard;
    shard.weight_sum = req.weight_sum;
    shard.datum_offset = req.datum_offset;
    return shard;
  }

  // Checks, before anything is loaded, that `dir` is a checkpoint SaveCheckpoint wrote for this
  // session's model: its files exist and every parameter is there with the model's shape. The
  // loader copies tensor by tensor, so a mismatch found half way would leave the session's
  // weights half replaced; checked first, a wrong folder changes nothing.
  absl::Status CheckLoadable(const std::string& dir) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      return absl::NotFoundError(absl::StrCat("directory: \"", dir, "\" does not exist on the session's worker"));
    for (const char* file : {"trainer_state.json", "optimizer.safetensors"}) {
      if (!fs::exists(fs::path(dir) / file, ec))
        return absl::FailedPreconditionError(absl::StrCat("directory: \"", dir, "\" is not a checkpoint SaveCheckpoint "
                                                          "wrote (no ", file, ")"));
    }
    if (trainer->model()->lora().enabled()) {  // a LoRA session's checkpoints hold its adapters
      if (absl::Status s = model::CheckLoraAdapter(trainer->model(), dir); !s.ok())
        return absl::FailedPreconditionError(absl::StrCat("directory: ", s.message(), "; nothing was loaded"));
      return absl::OkStatus();
    }
    absl::StatusOr<model::SafetensorsCheckpoint> ckpt = model::SafetensorsCheckpoint::Open(dir);
    if (!ckpt.ok()) return absl::Status(ckpt.status().code(), absl::StrCat("directory: ", ckpt.status().message()));
    for (const auto& p : trainer->model()->named_parameters()) {
      const model::SafetensorsFile* file = ckpt->FileOf(p.key());
      if (file == nullptr)
        return absl::FailedPreconditionError(absl::StrCat("directory: \"", dir, "\" lacks tensor '", p.key(),
                                                          "' of the session's model; nothing was loaded"));
      const std::vector<int64_t>& shape = file->tensors().at(p.key()).shape;
      if (shape != p.value().sizes().vec())
        return absl::FailedPreconditionError(
            absl::StrCat("directory: \"", dir, "\" holds '", p.key(), "' of shape [", absl::StrJoin(shape, ", "),
                         "], the session's model has [", absl::StrJoin(p.value().sizes().vec(), ", "),
                         "]; nothing was loaded"));
    }
    return absl::OkStatus();
  }

  RlResponse Run(const RlRequest& req) {
    RlResponse out;
    engine::Trainer& t = *trainer;
    switch (req.method) {
      case RlMethod::kForwardBackward: {
        engine::LossSpec loss;
        absl::StatusOr<engine::LossKind> kind = engine::ParseLossKind(req.loss_kind);
        if (!kind.ok()) {
          out.status = kind.status();
          return out;
        }
        loss.kind = *kind;
        if (req.clip_low > 0) loss.clip_low = req.clip_low;
        if (req.clip_high > 0) loss.clip_high = req.clip_high;
        absl::StatusOr<engine::ForwardBackwardResult> r = t.ForwardBackward(req.batch, loss, Shard(req));
        if (!r.ok()) {
          out.status = r.status();
          return out;
        }
        out.logprobs = std::move(r->logprobs);
        out.loss = r->loss;
        out.weight_sum = r->weight_sum;
        out.mismatch_mean = r->mismatch.mean_abs();
        out.mismatch_max = r->mismatch.max_abs;
        out.mismatch_tokens = r->mismatch.tokens;
        out.clipped_tokens = r->clipped_tokens;
        out.tokens = r->tokens;
        out.seconds = r->seconds;
        out.step = t.step();
        return out;
      }
      case RlMethod::kOptimStep: {
        engine::AdamWOptions adam = trainer_options.optimizer;
        adam.lr = req.lr;
        if (req.beta1 != 0 || req.beta2 != 0) {
          adam.beta1 = req.beta1;
          adam.beta2 = req.beta2;
        } else {
          adam.beta1 = 0.9;
          adam.beta2 = 0.95;
        }
        adam.eps = req.eps > 0 ? req.eps : 1e-8;
        adam.weight_decay = req.weight_decay;
        absl::StatusOr<engine::OptimStepResult> r = t.OptimStep(adam);
        if (!r.ok()) {
          out.status = r.status();
          return out;
        }
        out.step = r->step;
        out.grad_norm = r->grad_norm;
        out.lr = r->lr;
        return out;
      }
      case RlMethod::kForward: {
        absl::StatusOr<std::vector<std::vector<float>>> r = t.Forward(req.batch, Shard(req));
        if (!r.ok()) {
          out.status = r.status();
          return out;
        }
        out.logprobs = std::move(*r);
        for (const auto& l : out.logprobs) out.tokens += static_cast<int64_t>(l.size());
        return out;
      }
      case RlMethod::kSaveCheckpoint: {
        absl::StatusOr<std::string> path;
        if (req.directory.empty()) {
          if (options.checkpoint_dir.empty()) {
            out.status = absl::FailedPreconditionError(
                "directory: is required: the session has no checkpoint directory (spec.checkpoint.directory)");
            return out;
          }
          path = WriteCheckpoint(t, options.checkpoint_dir, options.keep, options.checkpoint_owner);
        } else {
          path = WriteFolderAtomically(req.directory, "directory", options.checkpoint_owner,
                                       [&t](const std::string& tmp) { return t.SaveCheckpoint(tmp); });
        }
        if (!path.ok()) {
          out.status = path.status();
          return out;
        }
        out.directory = *path;
        out.step = t.step();
        return out;
      }
      case RlMethod::kLoadCheckpoint: {
        if (absl::Status s = CheckLoadable(req.directory); !s.ok()) {
          out.status = s;
          return out;
        }
        if (absl::Status s = t.LoadCheckpoint(req.directory); !s.ok()) {
          out.status = absl::Status(s.code(), absl::StrCat("directory \"", req.directory, "\": ", s.message()));
          return out;
        }
        out.step = t.step();
        return out;
      }
      case RlMethod::kSample: {
        // The current weights: t.model() waits for a host optimizer update in flight. Decoding
        // runs on whole rows, so a context-parallel session is refused rather than sampled from
        // one shard (its model's attention would wait for the other ranks' all-to-alls).
        if (trainer_options.context_parallel.degree() > 1) {
          out.status = absl::UnimplementedError(absl::StrCat(
              "sample: sampling from a context-parallel session (parallel.context_parallel ",
              trainer_options.context_parallel.degree(), ") is not implemented; export_weights and sample "
              "from a session without context parallelism, or from the inference engine"));
          return out;
        }
        engine::SampleSpec spec = req.sample;
        if (req.draw_seed) spec.seed = std::random_device{}() * uint64_t{0x100000000} + std::random_device{}();
        engine::SamplerLimits limits;
        limits.max_positions = trainer_options.data.seq_len * std::max<int64_t>(1, trainer_options.data.batch_size);
        absl::StatusOr<engine::SampleResult> r = engine::Sample(t.model(), spec, limits);
        if (!r.ok()) {
          out.status = r.status();
          return out;
        }
        out.sample = *std::move(r);
        out.seed = spec.seed;
        out.tokens = out.sample.tokens;
        out.seconds = out.sample.seconds;
        return out;
      }
      case RlMethod::kExportWeights: {
        model::SaveOptions save;
        save.dtype = t.dtype();
        save.base_dir = t.options().model;  // tokenizer files: the export is a complete model folder
        if (!req.dtype.empty()) {
          absl::StatusOr<torch::Dtype> d = model::ParseDtype(req.dtype);
          if (!d.ok()) {
            out.status = absl::InvalidArgumentError(absl::StrCat("dtype: ", d.status().message()));
            return out;
          }
          save.dtype = *d;
        }
        absl::StatusOr<std::string> path =
            WriteFolderAtomically(req.directory, "directory", options.checkpoint_owner,
                                  [&t, &save](const std::string& tmp) {
              return model::ExportModel(t.model(), tmp, save);
            });
        if (!path.ok()) {
          out.status = path.status();
          return out;
        }
        out.directory = *path;
        return out;
      }
    }
    out.status = absl::InternalError("unknown RL method");
    return out;
  }
};

RlSession::RlSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RlSession::~RlSession() = default;

absl::StatusOr<std::unique_ptr<RlSession>> RlSession::Create(const EngineJobOptions& options,
                                                             const std::function<bool()>& abort) {
  try {
    auto impl = std::make_unique<Impl>();
    impl->options = options;
    impl->options.rl_session = true;  // its plan keeps every gradient to the step (planner::GradientsToStep)
    // Before any work, as an SFT run: a folder holding another job's steps fails the session now.
    if (!options.checkpoint_dir.empty() && options.rank == 0) {
      if (absl::Status s =
              CheckCheckpointFolder(options.checkpoint_dir, options.checkpoint_owner, "spec.checkpoint.directory");
          !s.ok())
        return s;
      RemoveStagingLeftovers(options.checkpoint_dir, options.checkpoint_owner);  // of a run that died mid-write
    }
    if (absl::Status s = BuildTrainerOptions(impl->options, &impl->trainer_options); !s.ok()) return s;
    if (options.world_size > 1) {  // as an SFT run (engine_job.cc)
      absl::StatusOr<torch::Device> device = engine::ParseDevice(impl->trainer_options.device);
      if (!device.ok()) return device.status();
      engine::RankGroupOptions go;
      go.rendezvous = options.rendezvous;
      go.rank = options.rank;
      go.world_size = options.world_size;
      go.device = *device;
      if (abort) go.abort = abort;
      // One group of all ranks (context parallel: every rank the whole batch, its positions of
      // each row; data parallel: every rank its slice of the batch's datums), or data parallel
      // over context-parallel groups (each group one slice).
      absl::StatusOr<engine::RankLayout> layout =
          engine::ConnectRankLayout(go, std::max(1, options.context_parallel));
      if (!layout.ok()) return layout.status();
      for (const engine::RankGroup* g : {&layout->context, &layout->data}) {
        if (!g->comm) continue;
        LogInfo(absl::StrFormat("session rank=%d/%d %s group of %d over %s (%s)", options.rank, options.world_size,
                                g == &layout->context ? "context-parallel" : "data-parallel", g->comm->world_size(),
                                engine::BackendName(g->choice.backend), g->choice.reason));
      }
      impl->comm = std::move(layout->context.comm);
      impl->data_comm = std::move(layout->data.comm);
      impl->trainer_options.context_parallel.group = impl->comm.get();  // null: none
      impl->trainer_options.communicator = impl->data_comm.get();       // null: one data-parallel rank
    }
    absl::StatusOr<std::unique_ptr<engine::Trainer>> created = engine::Trainer::Create(impl->trainer_options);
    if (!created.ok()) return created.status();
    impl->trainer = *std::move(created);
    if (!options.resume_from.empty()) {
      if (absl::Status s = impl->trainer->LoadCheckpoint(options.resume_from); !s.ok())
        return absl::Status(s.code(), absl::StrCat(options.resume_field, " ", options.resume_from, ": ", s.message()));
    }
    return std::unique_ptr<RlSession>(new RlSession(std::move(impl)));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("engine error: ", e.what()));
  }
}

RlResponse RlSession::Run(const RlRequest& request) {
  engine::Trainer& t = *impl_->trainer;
  engine::ResetPeakMemory(t.device());  // the peak reported is this call's
  // spec.profile.phase_times: rank 0 times the calls that train (the timer is process-wide).
  const bool timed = impl_->options.phase_times && impl_->options.rank == 0 &&
                     (request.method == RlMethod::kForwardBackward || request.method == RlMethod::kOptimStep);
  absl::Status timing = timed ? engine::StartPhaseTimes(t.device().is_cuda()) : absl::OkStatus();
  RlResponse out;
  try {
    out = impl_->Run(request);
  } catch (const std::exception& e) {  // a libtorch error must not kill the worker
    out = RlResponse{};
    out.status = absl::InternalError(absl::StrCat("engine error: ", e.what()));
  }
  if (timed && timing.ok()) {
    absl::StatusOr<std::vector<engine::PhaseTime>> phases = engine::StopPhaseTimes();
    timing = phases.status();
    if (phases.ok()) out.phases = *std::move(phases);
  }
  if (!timing.ok() && out.status.ok())
    out.status = absl::Status(timing.code(), absl::StrCat("spec.profile.phase_times: ", timing.message()));
  out.gpu_memory_peak_bytes = engine::ReadDeviceMemory(t.device()).peak_allocated;
  out.host_offload_bytes = t.memory().host_pool_bytes();
  return out;
}

int64_t RlSession::step() const { return impl_->trainer->step(); }

std::string RlSession::Describe() const {
  engine::Trainer& t = *impl_->trainer;
  return absl::StrFormat("model %s (%.2fM params, %s on %s), memory %s, step %d, batch plan %d x %d positions",
                         impl_->trainer_options.model,
                         static_cast<double>(t.model()->config().NumParameters()) / 1e6, c10::toString(t.dtype()),
                         t.device().str(), impl_->trainer_options.memory.Describe(), t.step(),
                         impl_->trainer_options.data.batch_size, impl_->trainer_options.data.seq_len);
}

}  // namespace odyssey::worker
