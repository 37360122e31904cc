// Communicator: the collectives the ranks of one job use (all-reduce, broadcast, barrier,
// all-to-all, all-gather, reduce-scatter), behind one small interface so the engine's parallel math does not care how ranks talk.
//
// Implementations:
//   SingleRankCommunicator  a world of one rank: every collective is the identity (the
//                   trainer's communicator when it trains alone, so that its one-rank case runs
//                   the same code as the P-rank case).
//   InProcessGroup  every rank is a thread of one process (tests of the parallel math).
//   TcpCommunicator every rank is a process; rank 0 hosts a rendezvous at host:port and the
//                   collectives run over a star of TCP connections through rank 0 (CPU jobs on
//                   loopback or a LAN).
//   NcclCommunicator every rank is a process with a GPU: c10d ProcessGroupNCCL over a TCPStore
//                   rendezvous (engine/parallel/nccl_communicator.h; built only where the
//                   linked libtorch has NCCL).
// Semantics shared by all implementations:
//   - Every rank calls the same collectives in the same order with tensors of the same count,
//     shapes and dtypes (a mismatch is detected where cheap and reported as INTERNAL).
//   - Results are bitwise identical on every rank: the reduction is computed once, in rank
//     order (rank 0 + rank 1 + ...), and copied to every rank. Floating-point tensors of less
//     than 32 bits are accumulated in fp32.
//   - Tensors may live on any device; they are staged through contiguous CPU buffers.
//   - A rank that disappears makes the others' pending collective fail (UNAVAILABLE) or time out
//     (DEADLINE_EXCEEDED) instead of hanging forever.
// Thread safety: one Communicator object is used by one thread at a time (the rank's thread).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace odyssey::engine {

enum class ReduceOp { kSum, kAvg };

// A collective in flight (Communicator::StartAllGather). Wait() returns its result once; a
// communicator whose transport runs collectives synchronously hands back a finished one.
// Thread safety: one thread (the rank's).
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  // REQUIRES: called at most once.
  virtual absl::StatusOr<torch::Tensor> Wait() = 0;
};

// A collective that finished when it was started (its result or its error).
class FinishedCollective : public PendingCollective {
 public:
  explicit FinishedCollective(absl::StatusOr<torch::Tensor> result) : result_(std::move(result)) {}
  absl::StatusOr<torch::Tensor> Wait() override { return std::move(result_); }

 private:
  absl::StatusOr<torch::Tensor> result_;
};

class Communicator {
 public:
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Replaces every tensor with the element-wise sum (or mean) of that tensor over all ranks.
  // Tensors are grouped by dtype and each group travels as one flat buffer.
  // REQUIRES: every tensor is defined; all ranks pass the same shapes and dtypes in order.
  virtual absl::Status AllReduce(std::vector<torch::Tensor>& tensors, ReduceOp op = ReduceOp::kSum);
  // Replaces every tensor with root's copy.
  virtual absl::Status Broadcast(std::vector<torch::Tensor>& tensors, int root = 0);
  // Returns once every rank has called Barrier.
  virtual absl::Status Barrier();
  // All-to-all (the layout change of Ulysses context parallelism): splits `input` along
  // `split_dim` into world_size() equal chunks, sends chunk j to rank j, and returns the chunks
  // received from ranks 0, 1, ... concatenated in rank order along `concat_dim`, on input's
  // device and in its dtype (any dtype: the bytes travel as they are). On one rank it returns
  // `input` itself. Example, P ranks: (B, H, S/P, D) split 1, concat 2 -> (B, H/P, S, D).
  // Not differentiable (engine/parallel/ulysses.h wraps it in an autograd Function).
  // REQUIRES: every rank passes the same shape and dtype; 0 <= split_dim, concat_dim < dim().
  // Errors: INVALID_ARGUMENT when a dim is out of range or world_size() does not divide
  // input.size(split_dim) (naming both), otherwise the transport's (a missing rank times out).
  virtual absl::StatusOr<torch::Tensor> AllToAll(const torch::Tensor& input, int64_t split_dim, int64_t concat_dim);
  // All-gather (parameter sharding): every rank passes its shard of n elements (any shape);
  // returns (P n,) 1-D, rank 0's elements first, then rank 1's, ..., on the shard's device and in
  // its dtype (the bytes travel as they are). On one rank: the shard flattened.
  // REQUIRES: every rank passes the same numel and dtype.
  virtual absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor& shard);
  // The same, started now and waited for later (a layer's parameters fetched while the layer
  // before it computes). Collectives started and not yet waited for still count in the
  // every-rank-same-order rule. The default runs AllGather now and returns it finished.
  virtual std::unique_ptr<PendingCollective> StartAllGather(const torch::Tensor& shard);
  // Reduce-scatter (sharded gradients): `full` (P n elements, any shape) is summed (or
  // averaged) over the ranks and this rank gets elements [rank n, (rank + 1) n) of the result,
  // (n,) 1-D on full's device and in its dtype; narrower floats accumulate in fp32, the
  // reduction in rank order, bitwise the slice an AllReduce would give. One rank: full flattened.
  // REQUIRES: every rank passes the same numel (a multiple of world_size()) and dtype.
  // Errors: INVALID_ARGUMENT when world_size() does not divide full.numel() (naming both).
  virtual absl::StatusOr<torch::Tensor> ReduceScatter(const torch::Tensor& full, ReduceOp op = ReduceOp::kSum);

 protected:
  // The primitives the grouping above is built on. `flat` is a contiguous CPU tensor, 1-D.
  virtual absl::Status AllReduceFlat(torch::Tensor& flat, ReduceOp op) = 0;
  virtual absl::Status BroadcastFlat(torch::Tensor& flat, int root) = 0;
  // `flat` (P, n) contiguous CPU: row j goes to rank j; on return row i holds what rank i sent
  // this rank (its row `rank()`).
  virtual absl::Status AllToAllFlat(torch::Tensor& flat) = 0;
};

// A world of one rank: rank 0 of 1. AllReduce (sum or mean), Broadcast (root 0) and Barrier
// leave the tensors as they are and never fail; Broadcast from another root is INVALID_ARGUMENT,
// as for every communicator.
class SingleRankCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }

 protected:
  // Never reached: Communicator's collectives return before staging when world_size() is 1.
  absl::Status AllReduceFlat(torch::Tensor& flat, ReduceOp op) override;
  absl::Status BroadcastFlat(torch::Tensor& flat, int root) override;
  absl::Status AllToAllFlat(torch::Tensor& flat) override;
};

// The reference reduction: sum (or mean) of `inputs` in index order, accumulated in fp32 for
// floating-point dtypes narrower than 32 bits; returned in the inputs' dtype.
torch::Tensor ReduceInOrder(const std::vector<torch::Tensor>& inputs, ReduceOp op);

// Ranks as threads of one process. Create the group, hand Rank(r) to the thread of rank r.
// Thread safety: the group is thread-safe; each Rank(r) communicator is used by one thread.
class InProcessGroup : public std::enable_shared_from_this<InProcessGroup> {
 public:
  // REQUIRES: world_size >= 1. `timeout` bounds how long a rank waits for the others.
  static std::shared_ptr<InProcessGroup> Create(int world_size,
                                                absl::Duration timeout = absl::Minutes(5));
  // The communicator of rank r (it keeps the group alive).
  std::unique_ptr<Communicator> Rank(int r);
  int world_size() const { return world_size_; }

 private:
  friend class InProcessCommunicator;
  InProcessGroup(int world_size, absl::Duration timeout);
  // Deposits `flat`, waits for every rank, lets the last arrival compute `combine(inputs)` once,
  // copies the result (or, with `part`, part(result, rank)) into `flat` on every rank.
  absl::Status Collective(int rank, torch::Tensor& flat,
                          const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& combine,
                          const std::function<torch::Tensor(const torch::Tensor&, int)>& part = nullptr);

  const int world_size_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  bool distributing_ ABSL_GUARDED_BY(mu_) = false;  // the result of the current op is ready
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int departed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<torch::Tensor> inputs_ ABSL_GUARDED_BY(mu_);
  torch::Tensor result_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);  // sticky: a timed-out collective breaks the group
};

// Ranks as processes over TCP. Rank 0 listens at `rendezvous` (host:port; port 0 picks a free
// one, see bound_port()), the others connect to it (retrying until `connect_timeout`).
struct TcpCommunicatorOptions {
  std::string rendezvous;  // "host:port" where rank 0 listens
  int rank = 0;            // in [0, world_size)
  int world_size = 1;      // >= 1
  // How long Create waits for all ranks to join, and how long one collective may wait on a peer.
  absl::Duration connect_timeout = absl::Seconds(60);
  absl::Duration op_timeout = absl::Minutes(10);
  // Asked about every 100 ms while waiting for the ranks to join: true gives up with CANCELLED
  // (the job was cancelled while a peer never came). Empty = never.
  std::function<bool()> abort;
};

class TcpCommunicator : public Communicator {
 public:
  // Rank 0: binds and listens, then waits for world_size - 1 peers (a client that sends no hello
  // within a few seconds is dropped). Others: connect and join; every wait asks options.abort.
  // Errors: INVALID_ARGUMENT (bad options, naming the field), UNAVAILABLE (cannot bind /
  // connect), DEADLINE_EXCEEDED (peers did not join in time), CANCELLED (options.abort).
  static absl::StatusOr<std::unique_ptr<TcpCommunicator>> Create(const TcpCommunicatorOptions& options);
  // Rank 0 only: binds now and returns; Join() then waits for the peers. Lets a test learn the
  // port picked for "host:0" before starting the other ranks.
  static absl::StatusOr<std::unique_ptr<TcpCommunicator>> Listen(const TcpCommunicatorOptions& options);
  absl::Status Join();
  ~TcpCommunicator() override;

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  int bound_port() const { return bound_port_; }  // rank 0: the port listened on
  // Rank 0, after Join: the numeric address rank r's connection came from (r >= 1), which the
  // other ranks can reach it at too where the network is symmetric (one host, a pod network);
  // for r = 0 the rendezvous host. Other ranks: empty.
  const std::vector<std::string>& peer_hosts() const { return peer_hosts_; }

 protected:
  absl::Status AllReduceFlat(torch::Tensor& flat, ReduceOp op) override;
  absl::Status BroadcastFlat(torch::Tensor& flat, int root) override;
  // Through rank 0: every rank sends its (P, n) rows to rank 0, which sends rank r the rows
  // addressed to it (the star's 2x traffic through rank 0; NCCL replaces it on GPUs).
  absl::Status AllToAllFlat(torch::Tensor& flat) override;

 private:
  explicit TcpCommunicator(TcpCommunicatorOptions options) : options_(std::move(options)) {}
  absl::Status SendTensor(int fd, uint32_t op, const torch::Tensor& flat);
  absl::Status RecvTensor(int fd, uint32_t op, torch::Tensor& flat);

  TcpCommunicatorOptions options_;
  int listen_fd_ = -1;
  int bound_port_ = 0;
  std::vector<int> peers_;  // rank 0: fd of rank r at peers_[r] (peers_[0] = -1); others: {fd to 0}
  std::vector<std::string> peer_hosts_;  // rank 0: see peer_hosts()
  uint64_t seq_ = 0;        // collectives issued, checked against the peer's on every message
};

// Splits "host:port"; errors name `field`.
absl::Status ParseHostPort(const std::string& address, const std::string& field, std::string* host, int* port);

}  // namespace odyssey::engine
