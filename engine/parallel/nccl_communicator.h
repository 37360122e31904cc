// NcclCommunicator: the Communicator of a job's ranks on GPUs, one process per GPU, over c10d's
// ProcessGroupNCCL with a TCPStore rendezvous hosted by rank 0 at the address the controller
// hands out. Built only where the linked libtorch has NCCL (ODYSSEY_WITH_NCCL: CMake defines it
// for a CUDA build whose libtorch ships ProcessGroupNCCL; the CPU build has no NCCL and this
// header declares nothing there).
//
// Every collective runs on the GPU, on the process group's NCCL stream, without staging through
// the host: tensors on another device (the CPU) are copied to this rank's GPU and back.
// Contract differences from the Communicator comment, both within it:
//   - the reduction order is NCCL's (a ring or a tree), not rank order; the result is still the
//     same on every rank. Floating-point tensors narrower than 32 bits are reduced in fp32
//     (converted on the device before the collective and rounded after), as the contract says.
//   - one rank runs the real NCCL calls too (only AllToAll returns its input itself), so a
//     single GPU exercises every call.
//   - StartAllGather returns before the all-gather is done: Wait() makes the caller's current
//     CUDA stream wait for it (the host does not block), so a layer's parameters travel while
//     the layer before it computes.
// A rank that disappears makes the others' collective fail when the process group's watchdog
// times out (options.op_timeout), reported as DEADLINE_EXCEEDED or INTERNAL.
// Thread safety: one thread at a time (the rank's), as every Communicator.
#pragma once

#ifdef ODYSSEY_WITH_NCCL

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/parallel/communicator.h"

namespace odyssey::engine {

struct NcclCommunicatorOptions {
  std::string rendezvous;  // "host:port": rank 0 hosts the TCPStore there, the others connect
  int rank = 0;            // in [0, world_size)
  int world_size = 1;      // >= 1
  int device_index = 0;    // this rank's GPU (cuda:device_index), >= 0 and < the device count
  // How long the rendezvous waits for every rank, and how long one collective may take before
  // the process group's watchdog fails it.
  absl::Duration connect_timeout = absl::Seconds(60);
  absl::Duration op_timeout = absl::Minutes(10);
};

class NcclCommunicator : public Communicator {
 public:
  // Joins the rendezvous (every rank calls; it returns when all have) and creates the process
  // group. Errors: INVALID_ARGUMENT naming the field (bad rank, world size, device, address),
  // FAILED_PRECONDITION when CUDA is not available, UNAVAILABLE / DEADLINE_EXCEEDED when the
  // rendezvous fails.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(const NcclCommunicatorOptions& options);
  ~NcclCommunicator() override;

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }

  absl::Status AllReduce(std::vector<torch::Tensor>& tensors, ReduceOp op = ReduceOp::kSum) override;
  absl::Status Broadcast(std::vector<torch::Tensor>& tensors, int root = 0) override;
  absl::Status Barrier() override;
  absl::StatusOr<torch::Tensor> AllToAll(const torch::Tensor& input, int64_t split_dim, int64_t concat_dim) override;
  absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor& shard) override;
  std::unique_ptr<PendingCollective> StartAllGather(const torch::Tensor& shard) override;
  absl::StatusOr<torch::Tensor> ReduceScatter(const torch::Tensor& full, ReduceOp op = ReduceOp::kSum) override;

 protected:
  // The flat primitives, for completeness of the interface: the collectives above do not use
  // them. `flat` is a CPU tensor; it goes to the GPU and back.
  absl::Status AllReduceFlat(torch::Tensor& flat, ReduceOp op) override;
  absl::Status BroadcastFlat(torch::Tensor& flat, int root) override;
  absl::Status AllToAllFlat(torch::Tensor& flat) override;

 private:
  struct State;  // the store and the process group (c10d types stay out of this header)
  NcclCommunicator(NcclCommunicatorOptions options, std::unique_ptr<State> state);

  NcclCommunicatorOptions options_;
  std::unique_ptr<State> state_;
};

}  // namespace odyssey::engine

#endif  // ODYSSEY_WITH_NCCL
