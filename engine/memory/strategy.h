// MemoryStack: the memory strategies of one job, chosen by one planner::MemoryStrategy (the
// torch-free value every component shares; planner/memory_strategy.h documents each knob and its
// default) and applied to a model as a LayerStackRunner plus a loss function. Each strategy is
// separate and switched by config; MemoryStrategy::Validate() says which combinations are
// refused (offload without recompute, kept attention without per-layer recompute).
//
//   recompute  none | layer | every_k: save only each layer's (or each group of k layers')
//              input; backward recomputes. every_k nests per-layer checkpoints inside each
//              group (inputs of the group's layers stay on the device only while that group's
//              backward runs), trading one more forward for k times fewer saved inputs.
//   offload    the saved inputs go to a pinned host pool (see SavedInputs), except the last
//              `device_resident` ones; the pool holds at most host_budget_bytes.
//   mlp_tile   the MLP half of every layer runs over tiles of this many positions (an MoE
//              layer's routing, dispatch and experts too: model/moe.h).
//   loss_tile  the LM head + cross-entropy runs over tiles of this many positions.
//   keep_attention  (with recompute=layer) each layer's attention output and log-sum-exp from
//              the first forward are kept on the device; the recompute runs only the
//              attention backward (see attention_stash.h).
//   keep_selection  (with recompute, models with DSA layers in the sparse stage) each DSA
//              layer's first forward keeps its pool selections in pinned host memory (4 bytes
//              a selected pool a token) and its recomputes reuse them instead of scoring every
//              pool again (model/hybrid.h, DsaAttentionImpl::set_selection_mode).
//   head_groups and optimizer_on_host are applied by the trainer (the attention backend and
//              AdamW), which reads them from the same strategy; the host optimizer's overlap
//              hangs on set_layer_hooks().
// Thread safety: one thread at a time (the training thread).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "engine/memory/attention_stash.h"
#include "engine/memory/host_pool.h"
#include "engine/memory/saved_inputs.h"
#include "model/causal_lm.h"
#include "planner/memory_strategy.h"

namespace odyssey::engine::memory {

// Callbacks around each group of decoder layers [first, first + count) the runner runs as one
// unit (a layer, or every_k layers). before_forward: before the group's forward (each pass
// through the runner; not before backward's recompute). after_backward: the group's backward
// has accumulated its parameters' gradients; only where a checkpoint gives the group a backward
// of its own (recompute layer / every_k), and it may run on autograd's device thread.
// after_forward: after the group's forward; `kept` says whether autograd holds the group's
// parameters for a backward (grad enabled and no recompute) or nothing of the forward refers to
// them any more (no grad, or a checkpoint that recomputes). before_recompute: before backward
// recomputes the group (a checkpoint's backward; autograd's thread, as after_backward).
// (Parameter sharding gathers and frees a layer's weights through these.) Any may be empty.
struct LayerHooks {
  std::function<void(int64_t first, int64_t count)> before_forward;
  std::function<void(int64_t first, int64_t count)> after_backward;
  std::function<void(int64_t first, int64_t count, bool kept)> after_forward;
  std::function<void(int64_t first, int64_t count)> before_recompute;
};

class MemoryStack {
 public:
  // REQUIRES nothing: an invalid strategy is refused (INVALID_ARGUMENT naming the field).
  static absl::StatusOr<std::unique_ptr<MemoryStack>> Create(const planner::MemoryStrategy& strategy,
                                                             int64_t num_layers);

  // Allocates the host pool for batches of B x S (once per job; again only for a larger
  // batch). Errors if the pool would exceed the host budget, saying by how much.
  absl::Status Prepare(int64_t B, int64_t S, int64_t hidden, torch::Dtype dtype);
  // Runs the decoder stack with the configured recompute / offload / tiling.
  model::LayerStackRunner Runner();
  // Masked cross-entropy sum (fp32 scalar): tiled when loss_tile > 0.
  torch::Tensor LossSum(const torch::Tensor& hidden, const torch::Tensor& head_weight, const torch::Tensor& labels,
                        const torch::Tensor& mask);
  // Per-token log p(label), fp32 (B, S): tiled when loss_tile > 0 (RL losses).
  torch::Tensor TokenLogprobs(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                              const torch::Tensor& labels);

  // The trainer's seam for the host optimizer (wait for a layer's parameters, send its
  // gradients). Runners made before or after the call use the hooks set last.
  void set_layer_hooks(LayerHooks hooks) { hooks_ = std::move(hooks); }

  const planner::MemoryStrategy& strategy() const { return strategy_; }
  // Where StashingAttention records (used only with keep_attention).
  AttentionStash* attention_stash() { return &stash_; }
  int64_t host_pool_bytes() const { return pool_ ? pool_->allocated_bytes() : 0; }
  // Bytes of the checkpointed inputs on the device now (resident, taken or on their way back).
  int64_t saved_device_bytes() const { return saved_->device_bytes(); }
  int64_t NumCheckpoints() const;

 private:
  MemoryStack(const planner::MemoryStrategy& strategy, int64_t num_layers);
  // output_unused: only back-propagated through (see TiledMlpBlock). replay: an MoE layer reuses
  // the routing its last deciding pass recorded (a recompute; model/moe.h), and with
  // keep_selection a DSA layer the pool selections its first forward kept. keep: a first forward
  // whose layers a recompute will run again (a DSA layer keeps its selections).
  torch::Tensor RunLayer(model::DecoderLayer layer, const torch::Tensor& h, const model::LayerContext& ctx,
                         bool output_unused = false, bool replay = false, bool keep = false);

  planner::MemoryStrategy strategy_;
  int64_t num_layers_;
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<SavedInputs> saved_;
  AttentionStash stash_;
  LayerHooks hooks_;
};

}  // namespace odyssey::engine::memory
