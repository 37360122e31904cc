// Request validation for the controller: every rule a JobSpec or a request must satisfy.
//
// Each failure is an absl::Status whose message names the field (by its proto path, e.g.
// "spec.optimizer.lr") and the rule that failed, with the code the API promises:
// INVALID_ARGUMENT for malformed input. Functions are
// pure (they read the filesystem only to check that model and dataset paths are readable) and
// thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "odyssey/v1/odyssey.pb.h"
#include "server/paths.h"

namespace odyssey::server {

// Longest display_name accepted, in bytes.
inline constexpr size_t kMaxDisplayNameBytes = 256;
// Largest world_size a job may ask for.
inline constexpr int32_t kMaxWorldSize = 4096;
// Page size bounds of ListJobs (0 = kDefaultPageSize).
inline constexpr int32_t kDefaultPageSize = 50;
inline constexpr int32_t kMaxPageSize = 1000;
// Page size bounds of ListJobEvents (0 = kDefaultEventPageSize): a step event is ~100 bytes, so
// a full page stays far below the message size limit.
inline constexpr int32_t kDefaultEventPageSize = 1000;
inline constexpr int32_t kMaxEventPageSize = 10000;

// Sizes are bounded before any arithmetic on them, so no product of them overflows int64 (the
// planner multiplies tokens by widths up to the vocabulary and by bytes per element):
// data.batch_size <= kMaxBatchSize and data.seq_len x data.batch_size <= kMaxTokensPerStep.
inline constexpr int64_t kMaxBatchSize = int64_t{1} << 20;
inline constexpr int64_t kMaxTokensPerStep = int64_t{1} << 34;  // 16Gi token positions per rank
// Learning rates above this are refused naming the field (AdamW steps of 1e300 overflow the
// weights to inf: the engine would fail with an error that names nothing the caller set).
inline constexpr double kMaxLearningRate = 10.0;
// How much of a request's text an error message quotes back (the rest is elided).
inline constexpr size_t kMaxQuotedBytes = 128;

// RL sessions: idle time after which a session with no call ends SUCCEEDED, when
// spec.rl.idle_timeout_seconds is 0.
inline constexpr int64_t kDefaultIdleTimeoutSeconds = 3600;
// Most datums one TrainingService call may carry (a bound on per-call bookkeeping; the token
// budget is the session's data.seq_len x data.batch_size, checked by the controller).
inline constexpr int kMaxBatchDatums = 65536;
// Longest directory path a TrainingService call may name, in bytes.
inline constexpr size_t kMaxPathBytes = 4096;
inline constexpr size_t kMaxPathComponentBytes = 200;  // per component of such a path

// What a spec is checked for. kJob: a job to run (CreateJob). kPlan: PlannerService.Plan, which
// reads only model, data.seq_len, data.batch_size and memory, so the rules that make other fields
// required (optimizer.lr > 0, steps > 0, data.path for a file format) and the files a run reads
// (data.path, resume_from) are not checked; fields that are set are still range-checked alike.
enum class SpecUse { kJob, kPlan };

// Checks a JobSpec; `field` prefixes field names in messages ("spec").
// Resolves the model (a named shape or a checkpoint directory with config.json) to check
// seq_len against max_position_embeddings, and checks the dataset path is a readable file and
// resume_from a checkpoint folder an odyssey job wrote, of the model's shape, before `steps`.
absl::Status ValidateJobSpec(const odyssey::v1::JobSpec& spec, absl::string_view field = "spec",
                             SpecUse use = SpecUse::kJob);

absl::Status ValidateCreateJobRequest(const odyssey::v1::CreateJobRequest& request);
// PlannerService.Plan: the spec as SpecUse::kPlan; gpu_bytes and host_bytes >= 0 (0 = the workers').
absl::Status ValidatePlanRequest(const odyssey::v1::PlanRequest& request);
absl::Status ValidateListJobsRequest(const odyssey::v1::ListJobsRequest& request);
// page_size in [0, kMaxEventPageSize]; page_token empty or a positive event number.
absl::Status ValidateListJobEventsRequest(const odyssey::v1::ListJobEventsRequest& request);

// TrainingService edge checks: the job name ("job"), a non-empty batch, a known loss kind and
// its ppo clip range ("loss.kind", "loss.clip_low"), AdamW parameters finite and in range
// ("adam.lr"), sequence >= 0, and directories (absolute paths; required for LoadCheckpoint and
// ExportWeights). Per-datum rules (token ids in the vocabulary, array lengths, finite values,
// the inputs each loss needs) are the engine's (engine/rl_datum.h ValidateBatch), checked on the
// worker, whose INVALID_ARGUMENT reaches the client unchanged; the batch's size against the
// session's plan is the controller's (Controller::Train).
absl::Status ValidateForwardBackwardRequest(const odyssey::v1::ForwardBackwardRequest& request);
absl::Status ValidateOptimStepRequest(const odyssey::v1::OptimStepRequest& request);
absl::Status ValidateForwardRequest(const odyssey::v1::ForwardRequest& request);
absl::Status ValidateSaveCheckpointRequest(const odyssey::v1::SaveCheckpointRequest& request);
absl::Status ValidateLoadCheckpointRequest(const odyssey::v1::LoadCheckpointRequest& request);
absl::Status ValidateExportWeightsRequest(const odyssey::v1::ExportWeightsRequest& request);
// Sample: the job name, prompts present (at most as many as a batch's datums), sequence >= 0. The
// sampling rules that need the model (token ids, lengths, the session's position limit) and the
// parameters' ranges are the engine's (engine/sampler.h ValidateSample), checked on the worker
// in one place, their INVALID_ARGUMENT reaching the client unchanged.
absl::Status ValidateSampleRequest(const odyssey::v1::SampleRequest& request);
// One PushRollouts batch: a ForwardBackward's checks plus an OptimStep's.
absl::Status ValidateRolloutBatch(const odyssey::v1::RolloutBatch& batch);

// Path confinement (server/paths.h). Each checks the client-chosen paths of a request against
// `policy` for `tenant` (the caller's), and must run before the checks above, which read the
// model and dataset files: a tenant must not learn whether another tenant's files exist.
// JobSpec: model.name when it is a path (it holds a '/'; with confinement on, a name without
// one must be a named shape), read; data.path when set, read; checkpoint.directory when set,
// written (empty = the controller's default, Controller::DefaultCheckpointDir). `field`
// prefixes field names ("spec").
absl::Status CheckJobSpecPaths(const odyssey::v1::JobSpec& spec, const PathPolicy& policy, absl::string_view tenant,
                               absl::string_view field = "spec");
// TrainingService: the `directory` of save_checkpoint (written; empty = the job's default
// folder), load_checkpoint (read) and export_weights (written). Other calls have no paths.
absl::Status CheckTrainingCallPaths(const odyssey::v1::TrainingCall& call, const PathPolicy& policy,
                                    absl::string_view tenant);

// "jobs/{id}" with id a positive decimal number. `field` names the field in messages.
absl::StatusOr<int64_t> ParseJobName(absl::string_view name, absl::string_view field = "name");
std::string JobName(int64_t id);

}  // namespace odyssey::server
