// The one seam between the API's MemorySpec / JobSpec (proto/odyssey/v1) and the planner's
// torch-free MemoryFields, MemoryStrategy and PlanJob: the controller (CreateJob's admission and
// PlannerService.Plan) and the worker (the strategy it runs) convert and plan through these
// functions only, so they cannot disagree.
// Thread safety: pure functions.
#pragma once

#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "odyssey/v1/odyssey.pb.h"
#include "planner/memory_strategy.h"
#include "planner/planner.h"

namespace odyssey::planner {

// The spec's fields, set or unset as MemorySpec documents. INVALID_ARGUMENT naming
// "<prefix>.<field>" and the rule for a value no strategy can take ("spec.memory.offload:
// ('sometimes') must be on, off, auto or empty"), in server/validation.h's "field: rule" form.
absl::StatusOr<MemoryFields> MemoryFieldsFromProto(const v1::MemorySpec& spec, absl::string_view prefix = "spec.memory");
// JobSpec.lora as the engine's LoraConfig, validated (model-free rules); INVALID_ARGUMENT naming
// "<prefix>.<field>" and the rule. The dims rule needs the model: PlanModelJob checks it.
absl::StatusOr<model::LoraConfig> LoraFromProto(const v1::LoraSpec& spec, absl::string_view prefix = "spec.lora");
// Every field of `strategy` written out (nothing left unset).
void MemoryStrategyToProto(const MemoryStrategy& strategy, v1::MemorySpec* out);

// The planner's hardware for a rank on a machine with `device_memory_bytes` of GPU memory and
// `host_memory_bytes` of RAM, under the job's host budget (0 = HostBudget()'s default).
Hardware MachineHardware(int64_t device_memory_bytes, int64_t host_memory_bytes, int64_t spec_host_budget_bytes);

// The one planning rule for a JobSpec on one GPU rank (PlanJob): the model (spec.model.name,
// cut to nothing), its dtype ("auto" and "bfloat16" plan bf16, "float32" fp32), data.seq_len x
// data.batch_size positions, the memory fields; `hardware` as MachineHardware() gives it.
// INVALID_ARGUMENT for a model that does not resolve or fields that cannot run on it (naming
// the field).
// The positions one rank holds: data.seq_len over parallel.context_parallel (Ulysses shards
// every activation, checkpoint and tile by S/P; the attention's head-layout buffers of one
// round, S x Hq/P heads, are the same element count as the sharded (S/P, Hq) tensors the
// per-rank model counts). The planner plans one rank at this length.
int64_t RankSeqLen(const v1::JobSpec& spec);
// The ranks a job's parameters are sharded over: parallel.world_size with parallel.shard_params
// (ZeRO-3 over all of the job's ranks), else 1 (planner::ModelShape::shard_ranks).
int64_t ShardRanks(const v1::JobSpec& spec);
// The model a spec trains: spec.model.name resolved (errors name it) with spec.model's
// overrides applied (indexer_stage). What the controller plans and validates against, and what
// the worker loads.
absl::StatusOr<model::ModelConfig> SpecModelConfig(const v1::JobSpec& spec);
absl::StatusOr<JobPlan> PlanJobSpec(const v1::JobSpec& spec, const Hardware& hardware);
// The same for the spec's model already resolved to `config` (SpecModelConfig).
absl::StatusOr<JobPlan> PlanJobSpec(const v1::JobSpec& spec, const model::ModelConfig& config,
                                    const Hardware& hardware);

}  // namespace odyssey::planner
