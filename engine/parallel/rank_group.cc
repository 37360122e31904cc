#include "engine/parallel/rank_group.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#ifdef ODYSSEY_WITH_NCCL
#include <ATen/cuda/CUDAContext.h>

#include "engine/parallel/nccl_communicator.h"
#endif

#include "absl/strings/str_cat.h"

namespace odyssey::engine {
namespace {

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
  return name;
}

int64_t AsSigned(uint64_t v) {
  int64_t s;
  std::memcpy(&s, &v, sizeof(s));
  return s;
}

uint64_t AsUnsigned(int64_t v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
}


}  // namespace

const char* BackendName(CollectiveBackend backend) { return backend == CollectiveBackend::kNccl ? "nccl" : "tcp"; }

absl::StatusOr<int> FreePort(bool loopback) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("picking a free port: socket: ", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(loopback ? INADDR_LOOPBACK : INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string why = std::strerror(errno);
    close(fd);
    return absl::UnavailableError(absl::StrCat("picking a free port: ", why));
  }
  close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

bool NcclBuilt() {
#ifdef ODYSSEY_WITH_NCCL
  return true;
#else
  return false;
#endif
}

BackendChoice ChooseBackend(const std::vector<RankPlace>& places, bool nccl_built) {
  BackendChoice c;
  if (places.size() < 2) {
    c.reason = "one rank";
    return c;
  }
  if (!nccl_built) {
    c.reason = "this build has no NCCL";
    return c;
  }
  for (size_t r = 0; r < places.size(); ++r) {
    if (!places[r].cuda) {
      c.reason = absl::StrCat("rank ", r, " computes on the CPU");
      return c;
    }
  }
  for (size_t a = 0; a < places.size(); ++a) {
    for (size_t b = a + 1; b < places.size(); ++b) {
      if (places[a].host == places[b].host && places[a].gpu_hi == places[b].gpu_hi &&
          places[a].gpu_lo == places[b].gpu_lo) {
        c.reason = absl::StrCat("ranks ", a, " and ", b, " share one GPU (NCCL needs a GPU per rank)");
        return c;
      }
    }
  }
  c.backend = CollectiveBackend::kNccl;
  c.reason = "every rank on a GPU of its own";
  return c;
}

RankPlace PlaceOf(const torch::Device& device) {
  RankPlace p;
  p.host = Fnv1a(HostName());
  if (!device.is_cuda()) return p;
  p.cuda = true;
#ifdef ODYSSEY_WITH_NCCL
  const int index = device.has_index() ? device.index() : 0;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(index);
  std::memcpy(&p.gpu_hi, prop->uuid.bytes, 8);
  std::memcpy(&p.gpu_lo, prop->uuid.bytes + 8, 8);
#else
  // Without NCCL the backend is TCP whatever the GPUs are; the index tells ranks apart.
  p.gpu_lo = static_cast<uint64_t>(device.has_index() ? device.index() : 0);
#endif
  return p;
}

absl::StatusOr<RankGroup> ConnectRanks(const RankGroupOptions& options) {
  TcpCommunicatorOptions co;
  co.rendezvous = options.rendezvous;
  co.rank = options.rank;
  co.world_size = options.world_size;
  co.connect_timeout = options.connect_timeout;
  co.op_timeout = options.op_timeout;
  co.abort = options.abort;
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> tcp = TcpCommunicator::Create(co);
  if (!tcp.ok()) return tcp.status();

  // Where every rank runs: (P, 4) int64 rows of host, cuda, UUID.
  const RankPlace mine = PlaceOf(options.device);
  torch::Tensor row = torch::tensor(
      {AsSigned(mine.host), static_cast<int64_t>(mine.cuda), AsSigned(mine.gpu_hi), AsSigned(mine.gpu_lo)},
      torch::kInt64);
  absl::StatusOr<torch::Tensor> all = (*tcp)->AllGather(row);
  if (!all.ok()) return all.status();
  torch::Tensor rows = all->view({options.world_size, 4});
  std::vector<RankPlace> places(static_cast<size_t>(options.world_size));
  for (int r = 0; r < options.world_size; ++r) {
    places[static_cast<size_t>(r)] = {AsUnsigned(rows[r][0].item<int64_t>()), rows[r][1].item<int64_t>() != 0,
                                      AsUnsigned(rows[r][2].item<int64_t>()), AsUnsigned(rows[r][3].item<int64_t>())};
  }
  RankGroup group;
  group.choice = ChooseBackend(places, NcclBuilt());
  if (group.choice.backend == CollectiveBackend::kTcp) {
    group.comm = *std::move(tcp);
    return group;
  }
#ifdef ODYSSEY_WITH_NCCL
  // Rank 0 picks the store's port; every rank learns it over the TCP group.
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(options.rendezvous, "rendezvous", &host, &port); !s.ok()) return s;
  torch::Tensor picked = torch::zeros({1}, torch::kInt64);
  absl::Status pick_status;
  if (options.rank == 0) {
    absl::StatusOr<int> free_port = FreePort(/*loopback=*/false);
    if (free_port.ok()) picked[0] = *free_port;
    else pick_status = free_port.status();  // sent as port 0: every rank fails alike
  }
  std::vector<torch::Tensor> to_send = {picked};
  if (absl::Status s = (*tcp)->Broadcast(to_send, 0); !s.ok()) return s;
  const int64_t store_port = to_send[0][0].item<int64_t>();
  if (store_port == 0)
    return pick_status.ok() ? absl::UnavailableError("nccl: rank 0 could not pick a port for the store") : pick_status;
  NcclCommunicatorOptions no;
  no.rendezvous = absl::StrCat(host, ":", store_port);
  no.rank = options.rank;
  no.world_size = options.world_size;
  no.device_index = options.device.has_index() ? options.device.index() : 0;
  no.connect_timeout = options.connect_timeout;
  no.op_timeout = options.op_timeout;
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> nccl = NcclCommunicator::Create(no);
  if (!nccl.ok())
    return absl::Status(nccl.status().code(), absl::StrCat("nccl: ", nccl.status().message()));
  group.comm = *std::move(nccl);
  return group;
#else
  return absl::InternalError("nccl chosen in a build without NCCL");
#endif
}

}  // namespace odyssey::engine
