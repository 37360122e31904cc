// Data parallelism as a pass over a model's parameters: every rank holds the whole model and
// optimizer, computes gradients on its own share of the batch, and GradientReducer sums them
// over the ranks, so that every rank clips and applies the same update and the ranks stay
// bitwise identical.
//
// The seam. The Trainer knows no parallelism beyond one call: its steps run
//
//     forward -> backward -> GradientReducer::Reduce -> clip -> AdamW
//
// for SFT steps (Trainer::Step) and RL updates (Trainer::OptimStep) alike, with the reducer
// built in Trainer::Create from the communicator (a SingleRankCommunicator when the trainer
// trains alone: every collective is then the identity and Reduce changes nothing, so the one-rank
// case is the same code as the P-rank case). A later pass that shards gradients and optimizer
// state (reduce-scatter instead of all-reduce) or splits sequences over ranks (context
// parallel) plugs in here: it replaces or wraps this class and keeps the contract of Reduce,
// "after it, every parameter's gradient is what the optimizer of this rank applies".
//
// Weighting is the loss's, before backward: each rank divides its loss by the whole batch's
// normalizer, the target tokens of all ranks for SFT (ShareTokens) or the RL batch's weight
// sum W (engine/rl_loss.h), so the sum of the ranks' gradients is the gradient of the whole
// batch's loss. Reduce then only sums. Reductions run once, in rank order, with fp32
// accumulation for gradients narrower than 32 bits (Communicator's contract).
// Thread safety: one thread at a time (the rank's), as its communicator.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/parallel/communicator.h"

namespace odyssey::engine {

// The counts of a batch split over the ranks, and this rank's share of the mean loss.
struct TokenShare {
  int64_t targets = 0;    // target tokens (positions in the loss), summed over the ranks
  int64_t positions = 0;  // positions processed, summed over the ranks
  // Multiplies this rank's mean loss over its own target tokens: max(1, local targets) /
  // max(1, targets), so the ranks' gradients sum to those of the mean over all target tokens
  // (not the mean of the ranks' means). Exactly 1 on one rank.
  double loss_scale = 1;
};

class GradientReducer {
 public:
  // REQUIRES: `comm` outlives the reducer; `params` are the parameters the optimizer updates,
  // the same list (shapes, dtypes, order) on every rank.
  GradientReducer(Communicator& comm, std::vector<torch::Tensor> params);
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Sums this rank's target tokens and positions over the ranks (one all-reduce, fp64).
  // Every rank must call together. Errors: the communicator's (the group is broken).
  absl::StatusOr<TokenShare> ShareTokens(int64_t local_targets, int64_t local_positions);

  // Replaces every parameter's gradient by its sum over the ranks, except those ReduceEarly
  // marked since the last Reduce (or Forget): they keep what ReduceEarly gave them, or what was
  // done with it since (a host optimizer takes and drops them); afterwards none is marked. A
  // parameter without a gradient on this rank contributes zeros; one that has none on any rank
  // stays without (the optimizer skips it, as when training alone) rather than getting a zero
  // gradient that would decay it. `riders` (small defined tensors, e.g. a loss share) are summed
  // in the same all-reduce. Every rank must call together, with riders of the same shapes and
  // dtypes. Errors: the communicator's (the group is broken); the gradients are then
  // unspecified and must be dropped.
  absl::Status Reduce(std::vector<torch::Tensor>& riders);

  // Sums the gradients of params[i] for i in `indices` over the ranks now, as Reduce would (the
  // same absent-gradient rule), and marks them so that the next Reduce skips them: a layer
  // group's gradients are final when its backward ends (one backward per step), so a host
  // optimizer may take the global batch's while the backward goes on. Every rank must call with
  // the same indices in the same order. Errors: the communicator's (the gradients are then
  // unspecified and must be dropped, with Forget).
  absl::Status ReduceEarly(const std::vector<int64_t>& indices);
  // Drops the early marks (a step that failed half-way).
  void Forget();

  Communicator& communicator() { return comm_; }

 private:
  // The sum over the ranks of params[i]'s gradients for i in `indices`, riders summed in the
  // same all-reduce.
  absl::Status ReduceIndices(const std::vector<int64_t>& indices, std::vector<torch::Tensor>& riders);

  Communicator& comm_;
  const std::vector<torch::Tensor> params_;
  std::vector<char> reduced_early_;  // per parameter (params_'s order): marked by ReduceEarly
};

}  // namespace odyssey::engine
