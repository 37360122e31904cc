// MemoryStrategy: every knob of a job's memory stack in one torch-free value, carried from the
// JobSpec through the controller's admission, the planner and the worker to
// engine::memory::MemoryStack::Create (DESIGN.md section 4.8). The defaults live here and only
// here: a default-constructed strategy is plain autograd (no recompute, nothing offloaded,
// nothing tiled), which is what a CPU worker runs for the fields a job leaves unset; on a GPU the
// planner fills the unset fields (planner/job_plan.h).
//
// MemoryFields is the partial form a JobSpec carries: each field is set or left to the planner.
// MemoryFields::ApplyTo(base) is the one rule for "the spec's fields win over a choice".
// Thread safety: plain values.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace odyssey::planner {

enum class Recompute {
  kNone,    // autograd keeps every layer's activations
  kLayer,   // save each layer's input; backward recomputes the layer
  kEveryK,  // save one input per group of every_k layers; nested per-layer recompute inside
};
// "none" | "layer" | "every_k".
absl::string_view RecomputeName(Recompute r);
// Parses RecomputeName()'s names; the error names `field` and the accepted values.
absl::StatusOr<Recompute> ParseRecompute(absl::string_view name, absl::string_view field = "memory.recompute");

struct MemoryStrategy {
  Recompute recompute = Recompute::kNone;
  int64_t every_k = 2;             // layers per checkpoint group (kEveryK only; >= 2)
  bool offload = false;            // checkpointed inputs to pinned host memory (needs recompute)
  int64_t device_resident = 0;     // with offload: the last N checkpoints stay on the GPU (>= 0)
  int64_t host_budget_bytes = 0;   // pinned host bytes the offload pool may hold; 0 = no limit
  int64_t mlp_tile = 0;            // positions per MLP tile; 0 = untiled
  int64_t loss_tile = 0;           // positions per LM-head + loss tile; 0 = untiled (full logits)
  int64_t head_groups = 1;         // KV-head groups attention runs one after another (>= 1)
  bool keep_attention = false;     // keep attention outputs + LSE of the first forward (kLayer)
  bool optimizer_on_host = false;  // fp32 masters + moments on the host, AdamW on CPU threads
  // DSA layers (sparse stage) keep the first forward's pool selections in pinned host memory;
  // their recomputes run no indexer scoring (needs recompute)
  bool keep_selection = false;
  // With optimizer_on_host: AdamW's moments in bf16 (the fp32 masters kept; 8 bytes a parameter
  // of host state where 12; engine/host_adamw.h HostOptimizerOptions::bf16_moments)
  bool bf16_moments = false;

  // Checks the strategy on its own; messages name the field and the rule
  // ("memory.every_k (1) must be >= 2").
  absl::Status Validate() const;
  // Checks what depends on the model: head_groups divides the KV heads.
  absl::Status ValidateForModel(int64_t num_layers, int64_t num_key_value_heads) const;
  // One line for logs and metrics: "recompute=layer offload=on(device_resident=3) mlp_tile=...".
  std::string Describe() const;
  // Number of saved layer inputs per step for a model of `num_layers` layers.
  int64_t NumCheckpoints(int64_t num_layers) const;

  bool operator==(const MemoryStrategy&) const = default;
};

// A job's memory fields: each set (a value) or left to the planner (nullopt).
struct MemoryFields {
  std::optional<Recompute> recompute;
  std::optional<int64_t> every_k;
  std::optional<bool> offload;
  std::optional<int64_t> device_resident;
  std::optional<int64_t> mlp_tile;
  std::optional<int64_t> loss_tile;
  std::optional<int64_t> head_groups;
  std::optional<bool> keep_attention;
  std::optional<bool> optimizer_on_host;
  std::optional<bool> keep_selection;
  std::optional<bool> bf16_moments;
  // Not a choice of the planner's: the pinned host memory the job may use; 0 = the machine's
  // limit (HostBudget()).
  int64_t host_budget_bytes = 0;

  // True when no field is left to the planner.
  bool AllSet() const;
  // True when any field is set (host_budget_bytes does not count: it is not a choice).
  bool AnySet() const;
  // `base` with every set field replacing base's. Offload off also drops the GPU-resident
  // count (it only means something with offload); keep_attention is dropped when the result
  // does not recompute every layer, keep_selection when it does not recompute, unless the spec
  // set them (then Validate() refuses them).
  MemoryStrategy ApplyTo(MemoryStrategy base) const;
};

// The one host-budget rule: the pinned host memory a job may use on a machine with
// `host_memory_bytes` of RAM; `spec_budget_bytes` > 0 (JobSpec.memory.host_budget_bytes) wins,
// else 85% of the host (the OS, the worker process and pageable buffers keep the rest).
int64_t HostBudget(int64_t host_memory_bytes, int64_t spec_budget_bytes);
// The GPU memory the planner plans for on a device of `device_memory_bytes`: less the CUDA
// context, cuBLAS/cuDNN handles and fragmentation slack.
int64_t UsableGpuBytes(int64_t device_memory_bytes);
// A CPU rank computes in host memory: what the planner plans for as its device on a host of
// `host_memory_bytes` is HostBudget's share (the spec's budget wins) less kCpuProcessBytes (the
// worker process itself: libtorch, the dataset, allocator slack); a spec's offload pool comes
// out of the same memory (planner::CpuHardware).
inline constexpr int64_t kCpuProcessBytes = int64_t{2} << 30;
int64_t UsableCpuBytes(int64_t host_memory_bytes, int64_t spec_budget_bytes);

}  // namespace odyssey::planner
