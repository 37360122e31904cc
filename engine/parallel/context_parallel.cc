#include "engine/parallel/context_parallel.h"

#include <torch/torch.h>

namespace odyssey::engine {

Batch ShardBatch(const Batch& batch, int64_t rank, int64_t P) {
  const int64_t B = batch.input_ids.size(0), S = batch.input_ids.size(1);
  TORCH_CHECK(P >= 1 && rank >= 0 && rank < P, "ShardBatch: rank ", rank, " out of [0, ", P, ")");
  TORCH_CHECK(S % P == 0, "ShardBatch: context_parallel (", P, ") must divide the sequence (", S, ")");
  if (P == 1) return batch;
  const int64_t s = S / P, start = rank * s;
  auto cut = [&](const torch::Tensor& t) { return t.defined() ? t.narrow(1, start, s).contiguous() : t; };  // (B, S/P)
  Batch shard;
  shard.input_ids = cut(batch.input_ids);
  shard.labels = cut(batch.labels);
  shard.loss_mask = cut(batch.loss_mask);
  shard.position_ids = batch.position_ids.defined()
                           ? cut(batch.position_ids)
                           : torch::arange(start, start + s, torch::kInt64).unsqueeze(0).expand({B, s}).contiguous();
  shard.doc_lens = batch.doc_lens;
  return shard;
}

void CommunicatorSequenceGroup::Broadcast(torch::Tensor& t, int root) const {
  std::vector<torch::Tensor> one = {t};
  absl::Status s = comm_.Broadcast(one, root);
  TORCH_CHECK(s.ok(), "context parallel: broadcast failed: ", s.ToString());
}

void CommunicatorSequenceGroup::AllReduceSum(torch::Tensor& t) const {
  std::vector<torch::Tensor> one = {t};
  absl::Status s = comm_.AllReduce(one, ReduceOp::kSum);
  TORCH_CHECK(s.ok(), "context parallel: all-reduce failed: ", s.ToString());
}

torch::Tensor CommunicatorSequenceGroup::AllGather(const torch::Tensor& t, int64_t dim) const {
  TORCH_CHECK(dim >= 0 && dim < t.dim(), "context parallel: all-gather along dim ", dim, " of a ", t.dim(),
              "-d tensor");
  absl::StatusOr<torch::Tensor> flat = comm_.AllGather(t.contiguous());  // (P n): rank 0's first
  TORCH_CHECK(flat.ok(), "context parallel: all-gather failed: ", flat.status().ToString());
  std::vector<int64_t> shape = {comm_.world_size()};
  shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
  return flat->view(shape).movedim(0, dim).flatten(dim, dim + 1).contiguous();
}

torch::Tensor CommunicatorSequenceGroup::AllToAll(const torch::Tensor& t, int64_t split_dim, int64_t concat_dim) const {
  absl::StatusOr<torch::Tensor> out = comm_.AllToAll(t, split_dim, concat_dim);
  TORCH_CHECK(out.ok(), "context parallel: all-to-all failed: ", out.status().ToString());
  return *out;
}

}  // namespace odyssey::engine
