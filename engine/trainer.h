// Trainer: one model, its optimizer and its data on one device; runs training steps.
//
// With memory.optimizer_on_host on CUDA the AdamW update runs on CPU threads after Step returns
// (engine/host_adamw.h), overlapping the next forward: the trainer waits for each decoder
// layer's parameters before that layer's forward (MemoryStack's layer hooks), for the
// embedding before the forward starts and for the final norm and head after the layers; in an
// SFT Step on one rank with checkpointed layers it sends each layer group's gradients to the
// host as soon as that group's backward is done (elsewhere gradients are final only after the
// last backward or the all-reduce, so Step sends them all). model(), EvalLoss and checkpoints
// wait for the whole update first.
//
// Data parallel (TrainerOptions::communicator with world_size > 1): every rank holds the whole
// model and optimizer, samples its own data (data seed + rank), and all-reduces its gradients
// before clipping, weighted so that the update equals one rank's step on the ranks' batches
// concatenated (the loss is the mean over all ranks' target tokens). Parameters are broadcast
// from rank 0 at creation, and every rank applies the same reduced gradients, so the ranks stay
// bitwise identical. Every rank must call Create and each step together. There is one code
// path: a trainer alone runs over a SingleRankCommunicator, whose collectives are identities.
// Parallelism is applied from outside the step (engine/parallel/data_parallel.h): the step
// calls GradientReducer::Reduce between backward and the clip, the one seam a sharding or
// context-parallel pass plugs into.
//
// A step is forward + backward + clip + AdamW for one batch (one sequence or a packed batch),
// with the loss averaged over the batch's masked target tokens. Memory strategies plug in
// through set_layer_runner() (the decoder layers run through it). Checkpoints are
// Hugging Face directories (config.json + model.safetensors) plus optimizer.safetensors and
// trainer_state.json, so a checkpoint both loads in transformers and resumes exactly.
//
// Context parallel (TrainerOptions::context_parallel with a group of P > 1 ranks): the P ranks
// of the group train on the same batch, rank r on positions [r S/P, (r+1) S/P) of every row
// (ShardBatch), with attention run by Ulysses all-to-alls around the configured backend
// (engine/parallel/ulysses.h; in head rounds with context_parallel.head_chunk). Each rank's loss
// is its shard's target-token sum over the batch's target-token count over all ranks, and the
// gradients are summed over the group (and then over the data-parallel communicator, when both
// are set) before the clip, so the step equals one rank's step on whole rows; the memory
// strategies (recompute, offload, tiles, kept attention) run on the shards unchanged. RL calls
// run under context parallelism too: every rank of the group gets the whole batch, each padded
// group of datums is right-padded to a multiple of P and rank r runs positions
// [r S'/P, (r+1) S'/P) of its rows (global RoPE positions); each rank's loss terms cover its
// positions only (the RL losses are sums over tokens), the logprobs are all-gathered so every
// rank returns the whole batch's, and OptimStep sums the pending gradients over the group before
// the clip. With a data-parallel communicator as well, each context-parallel group holds one
// data-parallel slice of the batch (the same slice on each of its ranks). Sampling
// (engine/sampler.h) decodes whole rows and stays refused there.
//
// RL sessions (DESIGN.md section 2) drive the same model, memory runner and optimizer through
// ForwardBackward / OptimStep / Forward instead of Step: batches of Datums (engine/rl_loss.h)
// from an orchestrator, gradients accumulated over any number of ForwardBackward calls until
// OptimStep applies them. Consecutive datums run together as right-padded rows of one batch,
// as many as fit in TrainerOptions::rl_group_tokens positions (rows x the group's longest; a
// longer datum runs alone); padding is causal-invisible to the real positions and never in the
// loss, and each group's backward frees its activations before the next group runs. Do not
// interleave Step/TrainStep with a ForwardBackward whose gradients are still pending: Step would
// fold them into its own update.
//
// RL calls are data parallel too (communicator with world_size > 1): the controller splits a
// batch into contiguous datum ranges, one per rank, and sends each rank its slice with an
// RlShard (the whole batch's W and the slice's offset). ForwardBackward normalizes by the whole
// batch's W, so the ranks' gradients sum to the whole batch's and their losses sum to its loss;
// OptimStep all-reduces the pending gradients and applies the same update on every rank (the
// ranks stay bitwise identical, as for Step). Either every rank computes or none does: a slice
// refused by validation, or a failure while computing on any rank, fails the call on every rank
// (see ForwardBackward). Forward is local (no collectives); checkpoints are local files (the
// controller saves from rank 0 and loads on every rank). Every rank must make the same
// ForwardBackward and OptimStep calls in the same order, as for Step.
//
// Sharded (TrainerOptions::shard_params): each rank keeps a 1/P slice of every parameter, of its
// gradient and of its AdamW state (fp32 master and moments; on the host too with
// optimizer_on_host), engine/parallel/sharding.h; the memory stack's layer hooks all-gather a
// layer's weights before its forward (and its recompute) with the next layer's prefetched, and
// reduce-scatter its gradients after its backward; the embedding and the final norm and head are
// whole from their first use to the end of the backward. The clip uses the global norm. The
// model's parameters are empty outside a forward (model() shows them so): read weights through
// a checkpoint. SaveCheckpoint and LoadCheckpoint are collectives then: every rank of the group
// calls; the whole weights and optimizer state are gathered and rank 0 writes the same files as
// an unsharded run (the other ranks' `dir` is not read), and a load cuts this rank's slices out
// of the whole files, so a checkpoint saved at one world size loads at any other (sharded or
// not). RL calls are refused (UNIMPLEMENTED) under sharding.
// Thread safety: one thread at a time.
#pragma once

#include <map>
#include <memory>
#include <string>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/data.h"
#include "engine/memory/strategy.h"
#include "engine/optimizer.h"
#include "engine/parallel/communicator.h"
#include "engine/parallel/context_parallel.h"
#include "engine/parallel/data_parallel.h"
#include "engine/parallel/sharding.h"
#include "engine/rl_loss.h"
#include "model/causal_lm.h"

namespace odyssey::engine {

struct TrainerOptions {
  std::string model = "tiny";     // named shape or HF checkpoint directory
  int64_t num_layers = 0;         // > 0: cut a named shape to this many layers (benchmarks)
  std::string device = "auto";    // auto (cuda if present, else cpu) | cpu | cuda | cuda:N
  std::string dtype = "auto";     // auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16
  std::string attention = "auto"; // attention backend: auto | math | sdpa | cudnn
  // Hybrid models with DSA layers: "dense_warmup" or "sparse" replaces the config's indexer
  // stage (a warm-up checkpoint trains sparse; the checkpoints written say the stage they ran);
  // "" = the model's own. Refused for a model without DSA layers.
  std::string indexer_stage;
  // Hybrid models with KDA layers: > 0 replaces the config's chunk size C (32 or 64; benchmarks,
  // model::ModelOverrides). 0 = the model's own.
  int64_t kda_chunk_size = 0;
  // Every memory knob (recompute, offload, tiles, head groups, kept attention, optimizer state
  // on the host); the default is plain autograd. See planner/memory_strategy.h.
  planner::MemoryStrategy memory;
  // With memory.optimizer_on_host: the host optimizer's worker threads and chunking (tests also
  // set deferred_cpu; see engine/host_adamw.h). Its bf16_moments is memory.bf16_moments's; setting
  // it true without memory.bf16_moments is refused.
  HostOptimizerOptions host_optimizer;
  // LoRA adapters (rank > 0): the base weights frozen in their dtype (no gradients, no optimizer
  // state), only the adapters trained; checkpoints are PEFT adapter folders (model/weights.h
  // SaveLoraAdapter) plus the optimizer state. Default: none (every parameter trains).
  model::LoraConfig lora;
  uint64_t seed = 0;              // model init (named shapes), adapter init and data sampling
  int64_t steps = 300;            // training steps (> 0)
  double grad_clip = 1.0;         // max global grad norm; <= 0 disables
  AdamWOptions optimizer;
  ScheduleOptions schedule;       // total_steps 0 = `steps`
  DataOptions data;               // vocab_size is taken from the model
  // RL calls: positions (rows x longest datum) run in one padded forward; 0 = data.batch_size x
  // data.seq_len, the shape the job's memory was planned for.
  int64_t rl_group_tokens = 0;
  // Data parallel over the communicator's ranks when its world_size > 1. nullptr trains alone
  // (over a SingleRankCommunicator the trainer owns). Not owned: it must outlive the trainer.
  Communicator* communicator = nullptr;
  // Context parallel when its group has more than one rank (see the file comment); the default
  // trains on whole rows.
  ContextParallelOptions context_parallel;
  // ZeRO-3 parameter sharding over the job's ranks (the context-parallel group when it has more
  // than one rank, else the communicator's; not both): see "Sharded" in the file comment.
  // false: every rank holds the whole model and optimizer.
  bool shard_params = false;
  absl::Status Validate() const;
};

struct StepResult {
  int64_t step = 0;          // steps completed after this one
  double loss = 0;           // mean over target tokens, nats
  // Hybrid models: the indexer KL (spec 2.3) summed over the DSA layers, this rank's batch; its
  // gradient (weight hybrid.indexer_loss_weight) trains only the indexers. 0 for dense models.
  double indexer_loss = 0;
  double grad_norm = 0;      // before clipping
  double lr = 0;
  int64_t tokens = 0;        // positions processed (B * S), summed over the ranks
  int64_t target_tokens = 0; // positions in the loss, summed over the ranks
  double seconds = 0;
  double tokens_per_second = 0;
  // MoE models (model/moe.h), this rank's forward: the load-balancing term included in `loss`
  // (0 without one) and the routing slots each expert took, summed over the MoE layers (empty
  // without MoE layers; their sum is this rank's tokens x top-k x MoE layers).
  double aux_loss = 0;
  std::vector<int64_t> expert_tokens;
  // Not OK when a collective failed (data parallel): nothing was updated, and the ranks must
  // stop (the group is broken).
  absl::Status status;
};

// A batch's loss and gradients without an update (Trainer::Gradients).
struct BatchGradients {
  double loss = 0;  // mean over the batch's target tokens (over all ranks)
  // Per parameter name, the gradient of `loss`, summed over the ranks as a step sums it;
  // parameters without a gradient are absent.
  std::map<std::string, torch::Tensor> grads;
};

// Where a data-parallel rank's slice sits in the whole batch the controller split (contiguous
// datum ranges, one per rank). The default ({0, 0}) is a whole batch on one rank.
struct RlShard {
  // > 0: W, the sum of the weights over the WHOLE batch (every rank's slice); the loss terms are
  // normalized by it instead of by the slice's own sum, so the ranks' gradients and losses add
  // up to the whole batch's. 0: not given; the slices' sums are all-reduced (data parallel) or
  // the local batch's sum is used (one rank). Must be finite and >= 0.
  double weight_sum = 0;
  // Index of this rank's first datum in the whole batch (>= 0): validation messages name datum
  // i of the slice as batch[datum_offset + i], its index in the request the user sent.
  int64_t datum_offset = 0;
};

// What ForwardBackward returns. Data parallel: each rank reports its slice; the controller
// combines the ranks' results as each field says.
struct ForwardBackwardResult {
  // Per datum of the local batch, the model's logprob of each target token (fp32, before this
  // call's update). Ranks: concatenate in rank order.
  std::vector<std::vector<float>> logprobs;
  // The sum of the local datums' loss terms / W (engine/rl_loss.h): the batch loss on one rank,
  // this rank's share of it with data parallel (ranks: sum).
  double loss = 0;
  double weight_sum = 0;      // W the loss was normalized by: the whole batch's (ranks: all equal)
  Mismatch mismatch;          // trainer-vs-sampler |logp - q| over weighted tokens (ranks: Mismatch fields' sum / max)
  int64_t clipped_tokens = 0; // ppo: weighted tokens whose gradient the clip removed (ranks: sum)
  int64_t tokens = 0;         // positions run (sum of the local datums' lengths) (ranks: sum)
  double seconds = 0;
};

struct OptimStepResult {
  int64_t step = 0;       // optimizer steps completed, this one included
  double grad_norm = 0;   // of the accumulated gradients, before clipping
  double lr = 0;
};

class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const TrainerOptions& options);
  // On CUDA, hands libtorch's cached pinned host blocks back to the system (the DSA layers' kept
  // selections live there; the next job's host pool allocates outside that cache).
  ~Trainer();

  // One step on the next batch of the trainer's data source.
  StepResult TrainStep();
  // One step on a given batch (CPU tensors; moved to the device here).
  StepResult Step(const Batch& batch);
  // Mean loss of `batch` without updating anything.
  double EvalLoss(const Batch& batch);
  // The loss of `batch` and the gradients a Step would clip and apply (reduced over the ranks),
  // without updating anything; the gradients are zeroed after (gradient checks). Every rank
  // calls together. Errors: a failed collective (the group is broken).
  absl::StatusOr<BatchGradients> Gradients(const Batch& batch);

  // RL: runs every datum forward and backward with `loss`; gradients add to those pending since
  // the last OptimStep (nothing is updated). The batch is validated first (INVALID_ARGUMENT
  // naming field, datum index (shard.datum_offset + i) and rule; nothing runs). A failure while
  // computing (INTERNAL, or RESOURCE_EXHAUSTED when the device is out of memory) drops the
  // pending gradients; a memory strategy that cannot prepare its host pool for the batch runs
  // nothing and keeps them.
  // Data parallel (world_size > 1): `batch` is this rank's slice of the whole batch and may be
  // empty (the rank computes nothing but joins the collectives). Every rank must call together.
  // If any rank's slice is invalid, every rank returns INVALID_ARGUMENT and nothing runs
  // anywhere: the invalid rank with its own message, the others with one starting "batch:
  // refused on another rank". If computing fails on any rank, every rank drops its pending
  // gradients and returns an error: the failing rank its own, the others INTERNAL starting
  // "forward_backward failed on another rank" (when nothing ran on any rank, every rank keeps
  // its pending gradients, as one rank does). A failed collective (UNAVAILABLE,
  // DEADLINE_EXCEEDED, INTERNAL) also drops the pending gradients; the group is then broken.
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(const std::vector<Datum>& batch, const LossSpec& loss,
                                                        const RlShard& shard = {});
  // RL: clips the pending gradients (TrainerOptions::grad_clip), applies AdamW with `adam`'s
  // hyperparameters and lr as given (the orchestrator owns the schedule), and zeroes them.
  // FAILED_PRECONDITION when no ForwardBackward ran since the last OptimStep; a non-finite
  // gradient norm skips the update and drops the gradients (INTERNAL).
  // Data parallel: every rank must call together. The pending gradients are summed over the
  // ranks (a rank without any contributes zeros) and every rank applies the same update;
  // FAILED_PRECONDITION on every rank when no rank has pending gradients; INVALID_ARGUMENT on
  // every rank when any rank's `adam` is invalid (the others' message starts "optim_step:
  // refused on another rank"); a non-finite norm fails every rank alike.
  absl::StatusOr<OptimStepResult> OptimStep(const AdamWOptions& adam);
  // RL: per datum, the model's logprob of each target token (fp32), without gradients.
  // Weights, sampler logprobs and advantages are not needed (checked only when present).
  // Local to the rank (no collectives): with data parallel an empty batch is allowed (returns
  // no logprobs), and validation names datums by shard.datum_offset + i (shard.weight_sum is
  // not read).
  absl::StatusOr<std::vector<std::vector<float>>> Forward(const std::vector<Datum>& batch, const RlShard& shard = {});

  // A Hugging Face folder (config.json + weights) plus optimizer.safetensors and
  // trainer_state.json. With LoRA: the PEFT adapter folder (adapter_config.json +
  // adapter_model.safetensors), the base's config.json (its shape, for resume checks), the
  // adapters' optimizer state and trainer_state.json; with lora.merge also merged/, a plain model
  // folder of the merged weights.
  absl::Status SaveCheckpoint(const std::string& dir);
  // Loads weights, optimizer state and the step counter written by SaveCheckpoint. Drops RL
  // gradients pending since the last OptimStep (they were computed on the replaced weights).
  absl::Status LoadCheckpoint(const std::string& dir);

  // Parameters whose gradients the last Step sent to the host optimizer from its backward's
  // layer hooks, off the GPU before the update (data-parallel replicas' after their all-reduce
  // there); 0 with the optimizer on the device, under context parallelism or sharding over
  // several ranks, and after Gradients.
  int64_t params_sent_in_backward() const { return params_sent_in_backward_; }

  // A runner of the caller's: the host optimizer then waits for every layer before the stack.
  void set_layer_runner(model::LayerStackRunner runner) {
    runner_ = std::move(runner);
    hooked_runner_ = false;
  }
  memory::MemoryStack& memory() { return *memory_; }
  int64_t step() const { return optimizer_->steps(); }
  // The model with its parameters final (waits for a host optimizer update in flight).
  model::CausalLM& model() {
    optimizer_->Finish();
    return model_;
  }
  DataSource& data() { return *data_; }
  torch::Device device() const { return device_; }
  torch::Dtype dtype() const { return dtype_; }
  const TrainerOptions& options() const { return options_; }

 private:
  Trainer(TrainerOptions options, model::CausalLM model, std::unique_ptr<DataSource> data, torch::Device device,
          torch::Dtype dtype);
  torch::Tensor Loss(const Batch& batch, int64_t* targets);
  // Forward and backward of this rank's part of `whole`, then the gradients (and the loss) summed
  // over the ranks: returns the whole batch's mean loss (1,) fp32 and fills `share`. On failure
  // the gradients are zeroed; exceptions from the compute propagate (the gradients zeroed too).
  // `send_early`: a host optimizer may take each layer group's gradients as its backward ends
  // (one rank, no context parallelism: they are final then); only when a Step's update follows.
  absl::StatusOr<torch::Tensor> ReducedGradients(const Batch& whole, TokenShare* share, bool send_early);
  // This rank's part of `batch`: its context-parallel shard, or the batch itself.
  Batch LocalShard(const Batch& batch) const;
  // Sums this rank's target tokens and positions over the context-parallel group and then the
  // data-parallel ranks; loss_scale is the local targets' share of all of them.
  absl::StatusOr<TokenShare> ShareTokens(int64_t local_targets, int64_t local_positions);
  // Sums the gradients (and riders) over the context-parallel group, then the data-parallel ranks.
  absl::Status ReduceGradients(std::vector<torch::Tensor>& riders);
  // The global gradient norm and clip factor (over the shards when sharded: a collective).
  absl::StatusOr<GradClip> ClipGradients();
  // Sharding: builds shards_ over `group` and the optimizer over the shards.
  absl::Status ShardParameters(Communicator& group);
  // Sharding: gathers unit u (0 the embedding, 1 + l decoder layer l, L + 1 the final norm and
  // head) or starts its prefetch, after the host optimizer's update of it.
  void GatherUnit(int64_t u);
  void PrefetchUnit(int64_t u);
  std::vector<int64_t> UnitParams(int64_t u) const;
  // config.json + model.safetensors, optimizer.safetensors (`optimizer_state`) and
  // trainer_state.json. REQUIRES: the model's parameters are whole.
  absl::Status WriteCheckpointFiles(const std::string& dir,
                                    const std::vector<std::pair<std::string, torch::Tensor>>& optimizer_state);
  absl::Status SaveShardedCheckpoint(const std::string& dir);
  int64_t ContextParallelDegree() const { return options_.context_parallel.degree(); }
  // model_->Hidden through runner_, waiting for the host optimizer's update of each part of the
  // model before it is read.
  torch::Tensor Hidden(const model::ForwardInputs& in);
  // The optimizer's indices of the parameters of decoder layers [first, first + count).
  std::vector<int64_t> LayerParams(int64_t first, int64_t count) const;
  // Connects the memory stack's layer hooks to the host optimizer (optimizer_on_host only).
  void HookHostOptimizer();
  // More than one rank: a rank's RL slice may then be empty (the whole batch is the controller's).
  bool DataParallel() const { return comm_->world_size() > 1; }
  // The dense warm-up (only the DSA indexers train: Create froze the rest): an SFT step's forward
  // runs without grad and each DSA layer sends its indexer KL's gradient in the forward
  // (model/hybrid.h, set_indexer_backward_in_forward); no backward through the layers, no recompute.
  bool IndexerBackwardInForwardStep() const;
  // The RL batch's one validation: `shard`, then `loss` (when given) and the batch's datums
  // (ValidateDatums); an empty batch only when `allow_empty`. The whole-batch weight rule is
  // ForwardBackward's (it needs the whole batch's W, agreed across the ranks).
  absl::Status ValidateRl(const std::vector<Datum>& batch, const LossSpec* loss, const RlShard& shard,
                          bool allow_empty) const;
  // Prepares the memory stack (host pool) for the batch's largest padded group.
  absl::Status PrepareRlMemory(const std::vector<Datum>& batch);
  // The compute of ForwardBackward on the local batch, each datum's term divided by `W`
  // (REQUIRES: PrepareRlMemory(batch) succeeded). Fills
  // r's per-datum fields, loss and tokens. Leaves the gradients as they are on failure (the
  // caller drops them). Catches every exception.
  absl::Status RunForwardBackward(const std::vector<Datum>& batch, const LossSpec& loss, double W,
                                  ForwardBackwardResult& r);
  // Sums `flags` over every rank of an RL call (the data-parallel ranks, then the context-parallel
  // group) and `values` over the data-parallel ranks only (a context-parallel group's ranks hold
  // the same slice, so its values count once). CPU float64 tensors; replaced by the sums.
  absl::Status SumOverRlRanks(torch::Tensor& flags, torch::Tensor& values);
  // SumOverRlRanks of (1 if this rank refuses, `value`) so that every rank decides alike:
  // returns the sum of `value` over the ranks; this rank's `valid` when it refuses;
  // INVALID_ARGUMENT `refused_elsewhere` when another rank does; a collective's failure (the
  // pending gradients dropped). One rank: `valid`, else `value`.
  absl::StatusOr<double> AgreeAcrossRanks(const absl::Status& valid, double value, absl::string_view refused_elsewhere);
  // Clips the (reduced) pending gradients, applies AdamW and zeroes them; drops them when the
  // norm is not finite (INTERNAL).
  absl::StatusOr<OptimStepResult> ApplyPendingGradients(const AdamWOptions& adam);
  // Drops the gradients pending since the last OptimStep.
  void DropRlGradients();
  // Groups of consecutive datums, [begin, end), that run as one padded batch (none when empty).
  std::vector<std::pair<size_t, size_t>> RlGroups(const std::vector<Datum>& batch) const;
  // One padded group of datums run forward: under context parallelism this rank's positions
  // [first, first + width) of every (right-padded) row; else all of them (first 0).
  struct RlGroupRun {
    // Per datum, the model's logprobs of the target tokens at this rank's positions
    // [first, first + local[i].size(0)) of the datum (fp32, differentiable under grad mode; empty
    // where the datum ends before `first`).
    std::vector<torch::Tensor> local;
    int64_t first = 0;
    int64_t width = 0;
    torch::Tensor rows;  // (R, width) fp32 detached: this rank's logprobs of every row
  };
  RlGroupRun GroupLogprobs(const std::vector<Datum>& batch, size_t begin, size_t end);
  // Each datum's logprobs of the whole datum, (S_i,) fp32 detached: the context-parallel group's
  // shards all-gathered (a collective: every rank calls, for the same group), else run.local.
  std::vector<torch::Tensor> WholeLogprobs(const RlGroupRun& run, const std::vector<Datum>& batch, size_t begin,
                                           size_t end);

  TrainerOptions options_;
  std::unique_ptr<Communicator> alone_;  // when options_.communicator is null
  Communicator* comm_ = nullptr;         // options_.communicator or alone_
  std::unique_ptr<GradientReducer> gradients_;
  std::unique_ptr<GradientReducer> cp_gradients_;  // over the context-parallel group, when P > 1
  std::unique_ptr<ShardedParameters> shards_;      // shard_params: what the optimizer updates
  model::CausalLM model_;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<AdamW> optimizer_;
  std::vector<torch::Tensor> params_;
  torch::Device device_;
  torch::Dtype dtype_;
  model::LayerStackRunner runner_;
  std::unique_ptr<memory::MemoryStack> memory_;
  bool rl_grads_pending_ = false;  // a ForwardBackward ran since the last OptimStep
  // Host optimizer seams: optimizer indices of the embedding, of each decoder layer, and of the
  // rest (final norm, untied head), in the forward's order.
  std::vector<int64_t> embed_params_, tail_params_;
  std::vector<std::vector<int64_t>> layer_params_;
  bool hooked_runner_ = true;       // runner_ is the memory stack's (its hooks fire)
  torch::Tensor aux_loss_;          // the last Loss()'s MoE load-balancing term (undefined: none)
  bool send_grads_early_ = false;   // inside an SFT backward whose gradients are final per group
  int64_t params_sent_in_backward_ = 0;
};

// "auto" | "cpu" | "cuda" | "cuda:N"; errors name the field and rule.
absl::StatusOr<torch::Device> ParseDevice(const std::string& name);

}  // namespace odyssey::engine
