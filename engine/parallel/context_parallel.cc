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

}  // namespace odyssey::engine
