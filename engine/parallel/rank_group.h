// ConnectRanks: one rank's communicator for a job's group of worker processes.
//
// Every rank first joins the TCP rendezvous the controller handed out (TcpCommunicator, rank 0
// listening). The ranks then tell each other where they run (host, CPU or GPU, the GPU's UUID)
// and pick the collective backend with ChooseBackend:
//   - NCCL (NcclCommunicator over c10d's ProcessGroupNCCL) when the build has NCCL and every
//     rank holds a GPU no other rank holds. Rank 0 picks a free port on the rendezvous host for
//     NCCL's TCPStore and sends it round over the TCP group, which is then closed.
//   - the TCP star otherwise: ranks on the CPU, or two ranks sharing one GPU (NCCL refuses two
//     ranks on one device), or a build without NCCL.
// The choice and its reason come back with the communicator, for the job's log.
// Every rank reaches the same choice (they decide on the same gathered list).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/parallel/communicator.h"

namespace odyssey::engine {

enum class CollectiveBackend { kTcp, kNccl };
const char* BackendName(CollectiveBackend backend);

// Where one rank runs.
struct RankPlace {
  uint64_t host = 0;  // a hash of the host name
  bool cuda = false;
  uint64_t gpu_hi = 0, gpu_lo = 0;  // the GPU's UUID (cuda only)
};

struct BackendChoice {
  CollectiveBackend backend = CollectiveBackend::kTcp;
  std::string reason;  // e.g. "ranks 0 and 1 share one GPU (NCCL needs a GPU per rank)"
};

// The backend for ranks at `places` (index = rank); nccl_built: this build links NCCL.
BackendChoice ChooseBackend(const std::vector<RankPlace>& places, bool nccl_built);

// Whether this build has NCCL (ODYSSEY_WITH_NCCL).
bool NcclBuilt();

// A TCP port free now on this host (bound to port 0 on the loopback or every address, read
// back, closed): for a rendezvous or store another process binds next. Another process may take
// it first; that bind then fails. UNAVAILABLE naming the system error.
absl::StatusOr<int> FreePort(bool loopback);

// This process's place when it computes on `device`.
RankPlace PlaceOf(const torch::Device& device);

struct RankGroupOptions {
  std::string rendezvous;  // "host:port" where rank 0 listens (the controller's address)
  int rank = 0;            // in [0, world_size)
  int world_size = 1;      // >= 2 (one rank needs no group)
  torch::Device device{torch::kCPU};  // where this rank computes
  absl::Duration connect_timeout = absl::Seconds(120);
  absl::Duration op_timeout = absl::Minutes(10);
  std::function<bool()> abort;  // asked while waiting for peers: true = CANCELLED
};

struct RankGroup {
  std::unique_ptr<Communicator> comm;
  BackendChoice choice;
};

// Joins the group (every rank calls; returns when all have). Errors: those of
// TcpCommunicator::Create (INVALID_ARGUMENT naming the field, UNAVAILABLE, DEADLINE_EXCEEDED,
// CANCELLED) and, when NCCL is chosen, of NcclCommunicator::Create, prefixed "nccl: ".
absl::StatusOr<RankGroup> ConnectRanks(const RankGroupOptions& options);

// A job's ranks as D = world_size / P data-parallel replicas of context-parallel groups of P
// consecutive ranks: rank r is rank r % P of context group r / P (the ranks sharing its
// sequences) and rank r / P of data group r % P (the ranks holding the same positions of
// different batches).
struct RankLayout {
  int context_parallel = 1;  // P
  int data_parallel = 1;     // D
  RankGroup context;         // comm null when P == 1
  RankGroup data;            // comm null when D == 1
};

// Joins the layout (every rank calls with the same P; options as for ConnectRanks, the job's
// rendezvous). P == 1 or P == world_size: one ConnectRanks group of every rank. Otherwise the
// job's TCP star first (rank 0 tells every rank the address each connected from), then each
// group's first rank listens on a port the system picks at that address, and every rank joins
// its context group and then its data group, each group choosing its backend as ConnectRanks
// does. Needs addresses the ranks reach each other at as rank 0 saw them (one host, or a flat
// network such as a Kubernetes pod network; not through NAT). Errors: INVALID_ARGUMENT when P
// does not divide world_size; ConnectRanks' errors, prefixed with the group they happened in.
absl::StatusOr<RankLayout> ConnectRankLayout(const RankGroupOptions& options, int context_parallel);

// Whether `status` is a ConnectRanks / ConnectRankLayout failure of the ranks to meet: UNAVAILABLE
// or DEADLINE_EXCEEDED while they joined (rank 0 could not listen at the rendezvous, its port
// taken by another process; a rank did not arrive in time; a peer left while they met). Nothing
// of the job ran, and another attempt (another port, other workers) may succeed. Both functions
// mark such errors with a status payload, so the mark survives the status being passed on
// unchanged; INVALID_ARGUMENT, CANCELLED and any other error are not marked.
bool RanksDidNotMeet(const absl::Status& status);

}  // namespace odyssey::engine
