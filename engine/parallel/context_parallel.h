// Context parallelism as the trainer applies it: the options (the group of ranks that share
// each sequence, UPipe's head chunk) and the shard of a batch one rank holds.
//
// Layout: a group of P ranks trains on the same batch; rank r holds positions
// [r S/P, (r+1) S/P) of every row. Each layer's activations are sharded alike, attention
// gathers whole rows over the heads (engine/parallel/ulysses.h), and the loss of a shard is the
// sum over its target tokens divided by the batch's target-token count over all ranks, so the
// ranks' losses and gradients sum to the whole batch's (the gradients are summed over the group
// before the clip, through GradientReducer like data parallelism's).
// Thread safety: plain values and functions.
#pragma once

#include <cstdint>

#include "engine/data.h"
#include "engine/parallel/communicator.h"
#include "model/sequence_group.h"

namespace odyssey::engine {

struct ContextParallelOptions {
  // The ranks that share each sequence (not owned; must outlive the trainer). null or a world of
  // one rank: no context parallelism (one rank holds whole rows). With data parallelism as well,
  // TrainerOptions::communicator is the group of ranks holding the same shard of different
  // batches (the same cp rank), and the gradients are summed over both.
  Communicator* group = nullptr;
  // Query heads per all-to-all round (UPipe's G): 0 = all heads in one round (plain Ulysses);
  // otherwise a multiple of P dividing the query heads (ValidateContextParallel).
  int64_t head_chunk = 0;

  int64_t degree() const { return group != nullptr ? group->world_size() : 1; }
};

// Rank `rank`'s positions [rank S/P, (rank+1) S/P) of every row: input_ids, labels, loss_mask
// and position_ids sliced. Labels are the batch's (the next token of the whole row), so a
// shard's last position predicts the next shard's first token; position_ids stay global (RoPE
// sees a position's place in the whole row; filled 0..S-1 when the batch has none); doc_lens are
// kept whole (documents are split on whole rows, after the all-to-all).
// REQUIRES: 0 <= rank < P, and P divides S.
Batch ShardBatch(const Batch& batch, int64_t rank, int64_t P);

// The model's view of a context-parallel group (model/sequence_group.h) over its communicator:
// the hybrid family's KDA and DSA layers run their collectives through it, as Ulysses does the
// dense attention's. A failed collective throws c10::Error naming the communicator's status.
// REQUIRES: `comm` outlives it; used by one thread at a time, as the communicator.
class CommunicatorSequenceGroup final : public model::SequenceGroup {
 public:
  explicit CommunicatorSequenceGroup(Communicator& comm) : comm_(comm) {}
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.world_size(); }
  void Broadcast(torch::Tensor& t, int root) const override;
  void AllReduceSum(torch::Tensor& t) const override;
  torch::Tensor AllGather(const torch::Tensor& t, int64_t dim) const override;
  torch::Tensor AllToAll(const torch::Tensor& t, int64_t split_dim, int64_t concat_dim) const override;

 private:
  Communicator& comm_;
};

}  // namespace odyssey::engine
