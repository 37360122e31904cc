// Parameter sharding (ZeRO-3 / FSDP) as a pass over a model's parameters: each of the P ranks of
// a group owns a flat 1/P slice of every parameter (and so of every layer), and the optimizer
// (AdamW with its fp32 masters and moments) runs over those slices only. Whole parameters exist
// only while a unit of the model (the embedding, one decoder layer, the final norm and head) is
// in use: all-gathered just before, freed after.
//
// Layout. Parameter i of N_i elements has a shard of n_i = ceil(N_i / P) elements per rank;
// rank r holds elements [r n_i, (r + 1) n_i) of the flattened parameter, the last rank's tail
// zero-padded. A shard is (1, n_i) for a parameter of 2+ dimensions and (n_i,) for a 1-D one,
// so AdamW's "decay only 2+-D parameters" rule treats it as it treats the whole; the padding
// has zero weight and zero gradient and stays zero. A unit's shards travel as one buffer.
//
// Life of a unit in a step (the trainer's layer hooks drive it, engine/memory/strategy.h):
//   forward   Gather (waiting for a prefetch started one unit earlier) and Prefetch the next;
//             with layer recompute the whole parameters are released as soon as the forward of
//             the unit is done (nothing of the forward refers to them); without, autograd keeps
//             them for the backward and they stay until it.
//   backward  (recompute) Gather again before the recompute, Prefetch the unit before it, and
//             after the unit's backward ReduceGradients: the gradients reduce-scattered (summed
//             over the ranks, in rank order, fp32 accumulation) into the shards' gradients, the
//             whole parameters and gradients freed. FinishBackward does the same for every unit
//             still whole when the backward ends (the embedding, the head, layers without
//             recompute).
// So every rank keeps 1/P of the weights, gradients and optimizer state, plus the whole
// parameters of the units in flight. The one-rank case is the same code over identity
// collectives.
// Every rank must run the same units in the same order (the same forward and backward): the
// collectives are matched by order. A collective that fails inside a forward or backward throws
// (c10::Error; the group is broken), as Ulysses' all-to-alls do.
// Thread safety: one thread at a time (the rank's; the backward's hooks may run on autograd's
// device thread while the rank's thread waits in backward()).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/optimizer.h"
#include "engine/parallel/communicator.h"

namespace odyssey::engine {

class ShardedParameters {
 public:
  // `named`: the model's parameters, whole and equal on every rank (broadcast first), on one
  // device; a unit's parameters of each dtype travel as one buffer (the hybrid family's fp32
  // A_log and dt_bias beside its bf16 weights: two). `units`: indices into `named`, each parameter in exactly one unit,
  // in the order the forward uses them. Takes this rank's shard of each parameter and frees the
  // whole tensors (the model's parameters are then empty until their unit is gathered).
  // `group` must outlive this object. Errors: INVALID_ARGUMENT naming a parameter in no unit or
  // in two.
  static absl::StatusOr<std::unique_ptr<ShardedParameters>> Create(
      Communicator& group, std::vector<std::pair<std::string, torch::Tensor>> named,
      std::vector<std::vector<int64_t>> units);
  ShardedParameters(const ShardedParameters&) = delete;
  ShardedParameters& operator=(const ShardedParameters&) = delete;

  // The shards, named as their parameters, in `named`'s order: what the optimizer updates.
  std::vector<std::pair<std::string, torch::Tensor>> NamedShards() const;
  std::vector<torch::Tensor> Shards() const;
  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  Communicator& group() { return group_; }

  // Makes the unit's parameters whole (the module's tensors), waiting for its prefetch when one
  // is in flight; nothing when already whole. Throws when the collective fails.
  void Gather(int64_t unit);
  // Starts the all-gather of `unit`; nothing when it is out of range, whole or in flight.
  void Prefetch(int64_t unit);
  // Frees the unit's whole parameters and their gradients (nothing when not whole).
  void Release(int64_t unit);
  // Reduce-scatters the unit's whole gradients (zeros for a parameter without one) and adds
  // them to the shards' gradients, then releases the unit. Throws when the collective fails.
  void ReduceGradients(int64_t unit);
  // ReduceGradients for every unit still whole, in unit order. Errors: the communicator's.
  absl::Status FinishBackward();
  // Releases every unit (after a forward without backward).
  void ReleaseAll();
  // Gathers every unit (checkpoints, exports). Errors: the communicator's.
  absl::Status GatherAll();
  // Copies every whole parameter's slice into its shard (after whole weights were loaded into
  // the model: every rank must hold the same whole values). REQUIRES: every unit is whole.
  void ShardWholeParameters();

  // The global gradient norm over the shards' gradients (sum of squares all-reduced) and the
  // factor that clips it to max_norm, as GradClipScale computes them for whole gradients.
  absl::StatusOr<GradClip> ClipScale(double max_norm);
  // Parameter `name`'s whole tensor (its shape) from a tensor shaped as its shard on every rank
  // (a gradient, an optimizer state); fp32 stays fp32. Errors: NOT_FOUND for an unknown name,
  // the communicator's.
  absl::StatusOr<torch::Tensor> GatherWhole(const std::string& name, const torch::Tensor& shard_like);
  // This rank's shard of parameter `name` cut from `whole` (its shape or numel), shaped as the
  // shard, in whole's dtype, on the shards' device. Errors: NOT_FOUND, INVALID_ARGUMENT on numel.
  absl::StatusOr<torch::Tensor> ShardOf(const std::string& name, const torch::Tensor& whole) const;
  // The whole gradient of every parameter whose shard has one (gradient checks).
  absl::StatusOr<std::map<std::string, torch::Tensor>> WholeGradients();

 private:
  struct Param {
    std::string name;
    torch::Tensor param;  // the module's tensor: whole while its unit is gathered, else empty
    std::vector<int64_t> shape;
    int64_t numel = 0;
    int64_t shard_numel = 0;  // n = ceil(numel / P)
    torch::Tensor shard;      // (1, n) or (n,), the model's dtype and device
  };
  // A unit's parameters of one dtype: they travel as one buffer.
  struct Part {
    std::vector<int64_t> params;
    int64_t shard_numel = 0;  // sum of the params' n
  };
  struct Unit {
    std::vector<int64_t> params;
    std::vector<Part> parts;  // by dtype, in the order of each dtype's first parameter
    bool whole = false;
    std::vector<std::unique_ptr<PendingCollective>> pending;  // one per part while in flight
  };
  ShardedParameters(Communicator& group, std::vector<Param> params, std::vector<Unit> units);
  // (sum n,) the part's shards one after another.
  torch::Tensor FlatShards(const Part& part) const;
  const Param* Find(const std::string& name) const;

  Communicator& group_;
  std::vector<Param> params_;
  std::vector<Unit> units_;
};

}  // namespace odyssey::engine
