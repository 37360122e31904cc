#include "engine/parallel/nccl_communicator.h"

#ifdef ODYSSEY_WITH_NCCL

#include <chrono>
#include <utility>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"

namespace odyssey::engine {

struct NcclCommunicator::State {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> group;
  torch::Device device{torch::kCUDA, 0};
};

namespace {

std::chrono::milliseconds Millis(absl::Duration d) { return std::chrono::milliseconds(absl::ToInt64Milliseconds(d)); }

c10d::ReduceOp ToNccl(ReduceOp op) { return op == ReduceOp::kAvg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM; }

// Narrower floats are reduced in fp32 (the Communicator contract).
torch::Dtype ReduceDtype(torch::Dtype d) {
  return torch::isFloatingType(d) && c10::elementSize(d) < 4 ? torch::kFloat32 : d;
}

// Runs `issue` (which starts a c10d collective) and waits for it; c10d reports failures by
// throwing (a watchdog timeout among them).
template <typename Issue>
absl::Status RunAndWait(const char* what, Issue issue) {
  try {
    c10::intrusive_ptr<c10d::Work> work = issue();
    work->wait();
  } catch (const std::exception& e) {
    const std::string message = absl::StrCat("nccl ", what, " failed: ", e.what());
    if (message.find("imeout") != std::string::npos || message.find("imed out") != std::string::npos)
      return absl::DeadlineExceededError(message.substr(0, 2000));
    return absl::InternalError(message.substr(0, 2000));
  }
  return absl::OkStatus();
}

// An all-gather in flight: the output buffer lives here until Wait.
class NcclPendingGather : public PendingCollective {
 public:
  NcclPendingGather(c10::intrusive_ptr<c10d::Work> work, torch::Tensor input, torch::Tensor output, torch::Device back)
      : work_(std::move(work)), input_(std::move(input)), output_(std::move(output)), back_(back) {}
  absl::StatusOr<torch::Tensor> Wait() override {
    try {
      work_->wait();  // the current stream waits for the NCCL stream
    } catch (const std::exception& e) {
      return absl::InternalError(std::string("nccl all-gather failed: ") + std::string(e.what()).substr(0, 2000));
    }
    input_ = torch::Tensor();
    return output_.to(back_);
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  torch::Tensor input_;  // kept alive while the collective reads it
  torch::Tensor output_;
  torch::Device back_;
};

// A failed start, reported at Wait.
class FailedGather : public PendingCollective {
 public:
  explicit FailedGather(absl::Status s) : status_(std::move(s)) {}
  absl::StatusOr<torch::Tensor> Wait() override { return status_; }

 private:
  absl::Status status_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(const NcclCommunicatorOptions& options) {
  if (options.world_size < 1)
    return absl::InvalidArgumentError(absl::StrCat("world_size (", options.world_size, ") must be >= 1"));
  if (options.rank < 0 || options.rank >= options.world_size)
    return absl::InvalidArgumentError(
        absl::StrCat("rank (", options.rank, ") must be in [0, world_size (", options.world_size, "))"));
  if (!torch::cuda::is_available())
    return absl::FailedPreconditionError("nccl communicator: this build or machine has no CUDA device");
  if (options.device_index < 0 || options.device_index >= static_cast<int>(torch::cuda::device_count()))
    return absl::InvalidArgumentError(absl::StrCat("device_index (", options.device_index, ") must be in [0, ",
                                                   torch::cuda::device_count(), ")"));
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(options.rendezvous, "rendezvous", &host, &port); !s.ok()) return s;
  if (port <= 0 || port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("rendezvous (", options.rendezvous, "): the port must be in [1, 65535]"));
  auto state = std::make_unique<State>();
  state->device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(options.device_index));
  try {
    c10::cuda::CUDAGuard guard(state->device);
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(port);
    store_options.isServer = options.rank == 0;
    store_options.numWorkers = static_cast<std::size_t>(options.world_size);
    store_options.waitWorkers = true;
    store_options.timeout = Millis(options.connect_timeout);
    state->store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
    c10::intrusive_ptr<c10d::ProcessGroupNCCL::Options> nccl = c10d::ProcessGroupNCCL::Options::create();
    nccl->timeout = Millis(options.op_timeout);
    state->group = c10::make_intrusive<c10d::ProcessGroupNCCL>(state->store, options.rank, options.world_size, nccl);
    // Binds the group to this rank's GPU, so the first collective need not guess it.
    state->group->setBoundDeviceId(state->device);
  } catch (const std::exception& e) {
    const std::string message = absl::StrCat("nccl rendezvous at ", options.rendezvous, " failed: ", e.what());
    if (message.find("imeout") != std::string::npos || message.find("imed out") != std::string::npos)
      return absl::DeadlineExceededError(message.substr(0, 2000));
    return absl::UnavailableError(message.substr(0, 2000));
  }
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(options, std::move(state)));
}

NcclCommunicator::NcclCommunicator(NcclCommunicatorOptions options, std::unique_ptr<State> state)
    : options_(std::move(options)), state_(std::move(state)) {}

NcclCommunicator::~NcclCommunicator() {
  if (state_ && state_->group) {
    try {
      state_->group->shutdown();
    } catch (const std::exception&) {
      // A broken group cannot be shut down cleanly; its resources go with the process.
    }
  }
}

// One rank runs the real collectives too (NCCL has one-rank communicators): a test on one GPU
// exercises every call; only AllToAll returns its input itself, as the contract says.
absl::Status NcclCommunicator::AllReduce(std::vector<torch::Tensor>& tensors, ReduceOp op) {
  torch::NoGradGuard no_grad;
  c10::cuda::CUDAGuard guard(state_->device);
  // Grouped by reduction dtype: each group one flat buffer on the GPU.
  std::vector<torch::Dtype> dtypes;
  for (const torch::Tensor& t : tensors) {
    TORCH_CHECK(t.defined(), "communicator: undefined tensor");
    const torch::Dtype d = ReduceDtype(t.scalar_type());
    if (std::find(dtypes.begin(), dtypes.end(), d) == dtypes.end()) dtypes.push_back(d);
  }
  for (torch::Dtype d : dtypes) {
    std::vector<size_t> members;
    std::vector<torch::Tensor> parts;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (ReduceDtype(tensors[i].scalar_type()) != d) continue;
      members.push_back(i);
      parts.push_back(tensors[i].detach().reshape({-1}).to(state_->device, d));
    }
    std::vector<torch::Tensor> flat = {torch::cat(parts).contiguous()};  // (N,) on the GPU
    if (flat[0].numel() == 0) continue;
    c10d::AllreduceOptions o;
    o.reduceOp = ToNccl(op);
    if (absl::Status s = RunAndWait("all-reduce", [&] { return state_->group->allreduce(flat, o); }); !s.ok()) return s;
    int64_t offset = 0;
    for (size_t i : members) {
      torch::Tensor& t = tensors[i];
      t.copy_(flat[0].slice(0, offset, offset + t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Broadcast(std::vector<torch::Tensor>& tensors, int root) {
  if (root < 0 || root >= world_size())
    return absl::InvalidArgumentError(absl::StrCat("broadcast root (", root, ") must be in [0, ", world_size(), ")"));
  torch::NoGradGuard no_grad;
  c10::cuda::CUDAGuard guard(state_->device);
  for (torch::Tensor& t : tensors) {
    TORCH_CHECK(t.defined(), "communicator: undefined tensor");
    std::vector<torch::Tensor> one = {t.detach().to(state_->device).contiguous()};
    if (one[0].numel() == 0) continue;
    c10d::BroadcastOptions o;
    o.rootRank = root;
    if (absl::Status s = RunAndWait("broadcast", [&] { return state_->group->broadcast(one, o); }); !s.ok()) return s;
    if (rank() != root) t.copy_(one[0]);
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Barrier() {
  c10::cuda::CUDAGuard guard(state_->device);
  c10d::BarrierOptions o;
  o.device = state_->device;
  return RunAndWait("barrier", [&] { return state_->group->barrier(o); });
}

absl::StatusOr<torch::Tensor> NcclCommunicator::AllToAll(const torch::Tensor& input, int64_t split_dim,
                                                         int64_t concat_dim) {
  TORCH_CHECK(input.defined(), "communicator: all-to-all of an undefined tensor");
  const int64_t dims = input.dim();
  if (split_dim < 0 || split_dim >= dims || concat_dim < 0 || concat_dim >= dims)
    return absl::InvalidArgumentError(absl::StrCat("all-to-all: split_dim (", split_dim, ") and concat_dim (",
                                                   concat_dim, ") must be in [0, ", dims, ")"));
  const int64_t P = world_size();
  if (input.size(split_dim) % P != 0)
    return absl::InvalidArgumentError(absl::StrCat("all-to-all: world_size (", P, ") must divide dim ", split_dim,
                                                   " of the input (", input.size(split_dim), ")"));
  if (P == 1) return input;
  torch::NoGradGuard no_grad;
  c10::cuda::CUDAGuard guard(state_->device);
  // (P, chunk...) rank-major on the GPU: row j goes to rank j, row i received came from rank i.
  torch::Tensor send = input.detach().unflatten(split_dim, {P, input.size(split_dim) / P}).movedim(split_dim, 0);
  std::vector<int64_t> chunk(send.sizes().begin() + 1, send.sizes().end());
  torch::Tensor in = send.to(state_->device).contiguous();
  torch::Tensor out = torch::empty_like(in);
  std::vector<int64_t> equal_splits;  // empty: P equal splits along dim 0
  if (in.numel() > 0) {
    c10d::AllToAllOptions o;
    if (absl::Status s = RunAndWait("all-to-all",
                                    [&] { return state_->group->alltoall_base(out, in, equal_splits, equal_splits, o); });
        !s.ok())
      return s;
  }
  return out.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1).to(input.device()).contiguous();
}

std::unique_ptr<PendingCollective> NcclCommunicator::StartAllGather(const torch::Tensor& shard) {
  TORCH_CHECK(shard.defined(), "communicator: all-gather of an undefined tensor");
  torch::NoGradGuard no_grad;
  c10::cuda::CUDAGuard guard(state_->device);
  torch::Tensor in = shard.detach().reshape({-1}).to(state_->device).contiguous();  // (n,)
  torch::Tensor out = torch::empty({world_size() * in.numel()}, in.options());       // (P n,)
  try {
    c10d::AllgatherOptions o;
    c10::intrusive_ptr<c10d::Work> work = state_->group->_allgather_base(out, in, o);
    return std::make_unique<NcclPendingGather>(std::move(work), in, out, shard.device());
  } catch (const std::exception& e) {
    return std::make_unique<FailedGather>(
        absl::InternalError(std::string("nccl all-gather failed: ") + std::string(e.what()).substr(0, 2000)));
  }
}

absl::StatusOr<torch::Tensor> NcclCommunicator::AllGather(const torch::Tensor& shard) {
  return StartAllGather(shard)->Wait();
}

absl::StatusOr<torch::Tensor> NcclCommunicator::ReduceScatter(const torch::Tensor& full, ReduceOp op) {
  TORCH_CHECK(full.defined(), "communicator: reduce-scatter of an undefined tensor");
  const int64_t P = world_size();
  if (full.numel() % P != 0)
    return absl::InvalidArgumentError(absl::StrCat("reduce-scatter: world_size (", P,
                                                   ") must divide the tensor's element count (", full.numel(), ")"));
  torch::NoGradGuard no_grad;
  c10::cuda::CUDAGuard guard(state_->device);
  const torch::Dtype d = ReduceDtype(full.scalar_type());
  torch::Tensor in = full.detach().reshape({-1}).to(state_->device, d).contiguous();  // (P n,)
  torch::Tensor out = torch::empty({in.numel() / P}, in.options());                   // (n,)
  c10d::ReduceScatterOptions o;
  o.reduceOp = ToNccl(op);
  if (absl::Status s = RunAndWait("reduce-scatter", [&] { return state_->group->_reduce_scatter_base(out, in, o); });
      !s.ok())
    return s;
  return out.to(full.device(), full.scalar_type());
}

absl::Status NcclCommunicator::AllReduceFlat(torch::Tensor& flat, ReduceOp op) {
  std::vector<torch::Tensor> one = {flat};
  return AllReduce(one, op);
}

absl::Status NcclCommunicator::BroadcastFlat(torch::Tensor& flat, int root) {
  std::vector<torch::Tensor> one = {flat};
  return Broadcast(one, root);
}

absl::Status NcclCommunicator::AllToAllFlat(torch::Tensor& flat) {
  absl::StatusOr<torch::Tensor> out = AllToAll(flat, 0, 0);
  if (!out.ok()) return out.status();
  flat.copy_(*out);
  return absl::OkStatus();
}

}  // namespace odyssey::engine

#endif  // ODYSSEY_WITH_NCCL
