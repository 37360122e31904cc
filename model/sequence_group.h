// The ranks that share one sequence under context parallelism, as the hybrid family's token
// mixers see them (model/hybrid.h): the collectives they run inside their forward and backward.
// The model stays free of process groups; the engine implements this over its Communicator
// (engine/parallel/context_parallel.h) and hands it to the model (CausalLMImpl::
// set_sequence_group).
//
// Every rank of the group must call the same collectives in the same order with the same
// shapes, which the training step guarantees (every rank runs the same layers). A failed
// collective throws (c10::Error naming the transport's status); the group is then broken.
// Thread safety: used by one thread at a time (the rank's training thread, or autograd's).
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace odyssey::model {

class SequenceGroup {
 public:
  virtual ~SequenceGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank's `t` becomes rank `root`'s (same shape and dtype on every rank; written in place).
  virtual void Broadcast(torch::Tensor& t, int root) const = 0;
  // Every rank's `t` becomes the element-wise sum over the ranks (in place; narrower floats are
  // summed in fp32, in rank order, so every rank gets the same bits).
  virtual void AllReduceSum(torch::Tensor& t) const = 0;
  // Every rank's `t` (same shape and dtype) concatenated along `dim`, rank 0's first.
  virtual torch::Tensor AllGather(const torch::Tensor& t, int64_t dim) const = 0;
  // Splits `t` along `split_dim` into size() chunks, sends chunk j to rank j and returns the
  // chunks received, rank 0's first, concatenated along `concat_dim`.
  virtual torch::Tensor AllToAll(const torch::Tensor& t, int64_t split_dim, int64_t concat_dim) const = 0;
};

}  // namespace odyssey::model
