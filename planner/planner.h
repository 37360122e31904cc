// The planner: a memory model of odyssey's training step, in plain arithmetic (no libtorch), so
// the controller, the CLI and the benchmark link it as well as the worker.
//
// Predict() gives the peak GPU bytes (as libtorch's allocator counts them) and the host bytes
// (pinned, and the host optimizer's pageable state) of one training step of a model at a
// sequence length under a strategy. Choose() picks the cheapest strategy that fits a machine,
// or says by how much nothing fits. Every term of the peak is listed in Prediction::terms so a
// mismatch against a measurement can be traced. The model: what persists through the step
// (params; fp32 master and moments when the optimizer is on the device; workspaces) plus the
// largest of the phases that do not coexist:
//   loss backward       every kept attention output, the checkpoints on the GPU, the final
//                       hidden state and its gradient, a loss tile's logits and softmax (or the
//                       untiled loss) and the head's fp32 gradient accumulator; without
//                       recompute, every layer's saved activations
//   last layer backward all GPU checkpoints (or the fetched one and the prefetched next), every
//                       kept output, the head's gradient, the incoming gradient, one layer's
//                       recomputed activations and gradients, a nested group's other inputs
//   first layer backward one checkpoint, one kept output, every gradient but the first layer's
//                       (on the host: one layer's in flight), the same layer working set
//   optimizer step      every gradient (and AdamW's fp32 transients on a CPU rank)
// Gradients are counted as backward allocates them, checkpoints and kept outputs as backward
// frees them. The layer working set is fitted to the peaks measured on one H200
// (planner_test's rows, within +5%).
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"
#include "planner/memory_strategy.h"

namespace odyssey::planner {

struct ModelShape {
  int64_t layers = 0, hidden = 0, intermediate = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0;
  int64_t params = 0;       // all parameters (tied embeddings once)
  int64_t largest = 0;      // elements of the largest parameter tensor
  bool qk_norm = false;
  // Ranks the parameters are sharded over (ZeRO-3, parallel.shard_params): each keeps
  // ceil(params / shard_ranks) of the weights, gradients and optimizer state, plus the whole
  // weights of the units in use (embedding, head and two layers: the current one and the
  // prefetched one). 1: not sharded.
  int64_t shard_ranks = 1;
  // Ranks one sequence is spread over (context parallelism; the plan is one rank's, at seq_len /
  // context_ranks positions). For the hybrid family each KDA and DSA layer then also holds its
  // output gradient in the head layout beside the incoming one, and one broadcast tile's input
  // (model/hybrid.h). 1: one rank holds whole rows.
  int64_t context_ranks = 1;
  // With the optimizer on the host, whether every gradient stays on the GPU until the step
  // (GradientsToStep) rather than leaving with its layer's backward (engine/host_adamw.h
  // ReleaseGrads, which the trainer runs only for one SFT rank per sequence).
  bool gradients_to_step = false;
  // The hybrid family (model::Architecture::kHybrid): kda_layers + dsa_layers == layers, and
  // heads / kv_heads / head_dim are the DSA layers' main attention. Their terms in Predict() name
  // the CUDA path's tensors, sized by fits to hybrid-3b's peaks measured on one H200 (64K-512K).
  bool hybrid = false;
  int64_t kda_layers = 0, dsa_layers = 0;
  int64_t kda_heads = 0, kda_head_dim = 0, kda_chunk = 64;
  int64_t index_heads = 0, index_head_dim = 0, index_top_k = 0;
  bool dsa_sparse = false;  // the DSA layers select (indexer stage "sparse"): keep_selection acts
  // Mixture-of-Experts MLPs (model/moe.h), in either family; moe_layers 0: every MLP is dense.
  int64_t moe_layers = 0, experts = 0, top_k = 0, moe_intermediate = 0, shared_intermediate = 0;
  // > 0: LoRA (model::LoraConfig): the `params` are frozen (no gradients, masters or moments) and
  // only these adapter parameters train; `lora_largest` is the largest adapter tensor.
  int64_t lora_params = 0, lora_largest = 0;
  // > 0 (without LoRA): the indexer's dense warm-up, where only the DSA layers' indexers train
  // (these many of the `params`; `warmup_largest` the largest, their wq): the rest is frozen.
  int64_t warmup_params = 0, warmup_largest = 0;
  bool Frozen() const { return lora_params > 0 || warmup_params > 0; }  // a base without gradients
  int64_t Trainable() const {
    return lora_params > 0 ? lora_params : warmup_params > 0 ? warmup_params : params;
  }
  int64_t LargestTrainable() const {
    return lora_params > 0 ? lora_largest : warmup_params > 0 ? warmup_largest : largest;
  }
};
// `lora` (rank 0: none) adds the adapters and freezes the rest; a hybrid config in the
// dense_warmup indexer stage trains its indexers alone (engine/trainer.cc).
ModelShape ShapeOf(const model::ModelConfig& config, const model::LoraConfig& lora = {});

struct Hardware {
  int64_t gpu_bytes = int64_t{136} << 30;   // what the allocator may use (H200: 139 GiB less context)
  int64_t host_bytes = int64_t{110} << 30;  // pinned memory the pool may take (128 GiB host)
  // A CPU rank: gpu_bytes is its share of host memory (UsableCpuBytes) and host_bytes the same
  // memory: a prediction fits when both peaks together fit gpu_bytes. The planner chooses no
  // offload there (a spec may still ask for it); messages say "host memory" for the device.
  bool cpu = false;
};
// The machine a CPU rank is planned on (host memory as its device, UsableCpuBytes).
Hardware CpuHardware(int64_t host_memory_bytes, int64_t spec_budget_bytes);

struct Request {
  ModelShape model;
  int64_t seq_len = 0;
  int64_t batch_size = 1;
  MemoryStrategy strategy;
  Hardware hardware;
  int64_t param_bytes = 2;  // 2: bf16 params and activations; 4: fp32
  // The layer stack's first input (the embedding's output) kept like the other checkpoints, not
  // recomputed in its group's backward: a runner given no LayerContext::stack_input, and the
  // engine before 2026-12-06 (the twenty-first session), which planner_test's older measured
  // rows ran. Default: recomputed (engine/memory/strategy.cc).
  bool keeps_first_input = false;
  // A DSA layer's tiled backward keeps its norm's output (the engine before the same session)
  // where it now keeps the norm's input, which the layer holds anyway (model/hybrid.h, Heads'
  // input_norm): one (T, hidden) more. For planner_test's older measured rows.
  bool dsa_keeps_normed_input = false;
  // A nested group's (recompute every_k, k >= 2) backward starts the copy of the input below back
  // from the host as it begins, as the engine did before the same session; it now starts it at
  // the group's bottom layer (engine/memory/strategy.cc). For planner_test's older measured rows.
  bool prefetches_at_group_top = false;
};

struct Prediction {
  int64_t gpu_peak_bytes = 0;
  int64_t host_bytes = 0;
  bool fits = false;
  std::vector<std::pair<std::string, int64_t>> terms;  // the GPU peak, term by term (they sum to it)
  std::string peak_phase;  // "loss backward", "last layer's backward", "first layer's backward", "optimizer step"
  std::string Describe() const;
};
Prediction Predict(const Request& request);

// The fastest strategy that fits (recompute every layer, offload only when needed, checkpoints
// kept on the GPU where room allows, nested groups only when host memory is short), with tile
// sizes and head groups chosen. Only the fields `fixed` leaves unset are chosen: every candidate
// is `fixed.ApplyTo(candidate)`. An error (RESOURCE_EXHAUSTED) says by how much the least-bad
// candidate misses.
struct Choice {
  MemoryStrategy strategy;
  Prediction prediction;
};
struct ChooseOptions {
  MemoryFields fixed;                 // the job's own fields (they win)
  int64_t param_bytes = 2;            // 2: bf16; 4: fp32
  bool allow_keep_attention = false;  // consider keeping attention outputs (fastest where it fits)
};
absl::StatusOr<Choice> Choose(const ModelShape& model, int64_t seq_len, int64_t batch_size, const Hardware& hardware,
                              const ChooseOptions& options = {});

// The one planning rule (CreateJob, PlannerService.Plan and the worker alike): the job's fields
// over the planner's choice for the rest, predicted on `hardware`. The host budget a strategy
// may use is hardware.host_bytes (see HostBudget()). INVALID_ARGUMENT when the fields cannot run
// on this model (they name the field); otherwise a plan, which may not fit (fits false and a
// message saying by how much; see JobPlan::found).
struct JobPlanRequest {
  ModelShape model;
  int64_t seq_len = 0;
  int64_t batch_size = 1;
  int64_t param_bytes = 2;  // 2: bf16; 4: fp32
  MemoryFields fields;
  Hardware hardware;
  bool allow_keep_attention = false;
};
struct JobPlan {
  // False when the job left every field to the planner and no strategy fits: strategy and
  // prediction are then unset and the message names the least-bad candidate and by how much it
  // misses. When the job set fields and nothing fits, the strategy is the least-bad one with them.
  bool found = true;
  MemoryStrategy strategy;  // what a worker runs (host_budget_bytes = hardware.host_bytes)
  Prediction prediction;    // of `strategy`
  bool fits = false;
  std::string message;      // why it does not fit; empty when it does
};
absl::StatusOr<JobPlan> PlanJob(const JobPlanRequest& request);

// PlanJob for a job's model (a named shape or an HF checkpoint folder), dtype ("float32" plans
// fp32; "auto", "bfloat16" and "" plan bf16: the planner models GPU ranks), seq_len x batch_size
// positions and memory fields: the rule CreateJob, PlannerService.Plan (through
// planner/memory_spec.h) and the worker all apply. INVALID_ARGUMENT naming the JobSpec field
// ("spec.memory.attention_head_groups (3) must divide ...") when the model cannot take the fields.
// `shard_ranks`: ModelShape::shard_ranks (parallel.world_size when parallel.shard_params);
// `context_ranks`: ModelShape::context_ranks (parallel.context_parallel; seq_len is one rank's).
// `gradients_to_step`: ModelShape::gradients_to_step (GradientsToStep).
absl::StatusOr<JobPlan> PlanModelJob(const std::string& model_name, const std::string& dtype, int64_t seq_len,
                                     int64_t batch_size, const MemoryFields& fields, const Hardware& hardware,
                                     const model::LoraConfig& lora = {}, int64_t shard_ranks = 1,
                                     int64_t context_ranks = 1, bool gradients_to_step = false);
// The same for a model already resolved (callers that need its config anyway resolve it once).
// `lora`: the job's adapters (rank 0: full fine-tuning); INVALID_ARGUMENT naming spec.lora.<field>
// when they cannot run on the model.
absl::StatusOr<JobPlan> PlanModelJob(const model::ModelConfig& config, const std::string& dtype, int64_t seq_len,
                                     int64_t batch_size, const MemoryFields& fields, const Hardware& hardware,
                                     const model::LoraConfig& lora = {}, int64_t shard_ranks = 1,
                                     int64_t context_ranks = 1, bool gradients_to_step = false);

// Whether a job's gradients stay on the GPU until the step even with the optimizer on the host
// (ModelShape::gradients_to_step): RL sessions (gradients accumulate over forward_backward calls)
// and context-parallel ranks (their sums over two groups after the backward). Data-parallel
// replicas send each layer group's gradients after its all-reduce in the group's backward, as
// one rank does; sharded ranks are planned by their shards. The engine's rule
// (engine/trainer.cc, send_grads_early_).
bool GradientsToStep(bool rl_session, int64_t context_parallel);

// The longest sequence (a multiple of `granularity`) for which Choose() finds a strategy.
int64_t MaxSeqLen(const ModelShape& model, const Hardware& hardware, int64_t granularity = 16384,
                  const ChooseOptions& options = {});

}  // namespace odyssey::planner
