#include "engine/parallel/rank_group.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <tuple>
#include <utility>

#ifdef ODYSSEY_WITH_NCCL
#include <ATen/cuda/CUDAContext.h>

#include "engine/parallel/nccl_communicator.h"
#endif

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

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

namespace {

TcpCommunicatorOptions TcpOptions(const RankGroupOptions& options) {
  TcpCommunicatorOptions co;
  co.rendezvous = options.rendezvous;
  co.rank = options.rank;
  co.world_size = options.world_size;
  co.connect_timeout = options.connect_timeout;
  co.op_timeout = options.op_timeout;
  co.abort = options.abort;
  return co;
}

// The group's backend over its joined TCP star `tcp` (every rank calls): the star itself, or NCCL
// set up over it.
absl::StatusOr<RankGroup> ChooseAndConnect(const RankGroupOptions& options,
                                           absl::StatusOr<std::unique_ptr<TcpCommunicator>> tcp) {
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

// "host:port", the host bracketed when it is an IPv6 address.
std::string JoinHostPort(const std::string& host, int64_t port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

constexpr absl::string_view kRanksDidNotMeet = "type.odyssey.dev/RanksDidNotMeet";

// Marks a failure of the ranks to meet (see RanksDidNotMeet).
template <typename T>
absl::StatusOr<T> MarkMeetingFailure(absl::StatusOr<T> joined) {
  if (joined.ok()) return joined;
  absl::Status s = joined.status();
  if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) s.SetPayload(kRanksDidNotMeet, absl::Cord("1"));
  return s;
}

// ConnectRanks, its errors not yet marked.
absl::StatusOr<RankGroup> JoinRanks(const RankGroupOptions& options) {
  return ChooseAndConnect(options, TcpCommunicator::Create(TcpOptions(options)));
}

// ConnectRankLayout, its errors not yet marked.
absl::StatusOr<RankLayout> JoinLayout(const RankGroupOptions& options, int context_parallel) {
  const int W = options.world_size, P = context_parallel;
  if (P < 1 || W % P != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("context_parallel (", P, ") must be >= 1 and divide world_size (", W, ")"));
  RankLayout layout;
  layout.context_parallel = P;
  layout.data_parallel = W / P;
  if (P == 1 || P == W) {  // one group of every rank
    absl::StatusOr<RankGroup> all = JoinRanks(options);
    if (!all.ok()) return all.status();
    (P == 1 ? layout.data : layout.context) = *std::move(all);
    return layout;
  }
  // The job's star first: every rank's address as rank 0 saw it, and the ports the two kinds of
  // group leaders (rank g P of context group g, rank j of data group j) listen on.
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> world = TcpCommunicator::Create(TcpOptions(options));
  if (!world.ok()) return world.status();
  constexpr int64_t kHostBytes = 64;
  torch::Tensor hosts = torch::zeros({W, kHostBytes}, torch::kUInt8);  // (W, 64) NUL-padded
  if (options.rank == 0) {
    const std::vector<std::string>& seen = (*world)->peer_hosts();
    for (int r = 0; r < W; ++r) {
      const std::string& h = seen[static_cast<size_t>(r)];
      if (h.empty() || static_cast<int64_t>(h.size()) >= kHostBytes)
        return absl::InternalError(absl::StrCat("rank layout: no usable address for rank ", r, " ('", h, "')"));
      std::memcpy(hosts[r].data_ptr<uint8_t>(), h.data(), h.size());
    }
  }
  std::vector<torch::Tensor> to_send = {hosts};
  if (absl::Status s = (*world)->Broadcast(to_send, 0); !s.ok()) return s;
  auto host_of = [&](int r) {
    const torch::Tensor row = to_send[0][r].contiguous();
    return std::string(reinterpret_cast<const char*>(row.data_ptr<uint8_t>()));
  };
  const int rank = options.rank;
  const int cp_group = rank / P, cp_rank = rank % P;  // context group cp_group holds ranks [g P, (g + 1) P)
  const int dp_group = rank % P, dp_rank = rank / P;  // data group j holds ranks j, j + P, ...
  RankGroupOptions cp = options, dp = options;
  cp.rank = cp_rank;
  cp.world_size = P;
  dp.rank = dp_rank;
  dp.world_size = W / P;
  // A leader listens on a port the system picks, at its own address (as rank 0 saw it).
  std::unique_ptr<TcpCommunicator> cp_star, dp_star;
  torch::Tensor ports = torch::zeros({2}, torch::kInt64);  // (2,) this rank's: as context, as data leader
  for (auto [group_options, star, slot] : {std::tuple{&cp, &cp_star, 0}, std::tuple{&dp, &dp_star, 1}}) {
    if (group_options->rank != 0) continue;
    group_options->rendezvous = JoinHostPort(host_of(rank), 0);
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> listening = TcpCommunicator::Listen(TcpOptions(*group_options));
    if (!listening.ok()) return listening.status();
    *star = *std::move(listening);
    ports[slot] = (*star)->bound_port();
  }
  absl::StatusOr<torch::Tensor> all_ports = (*world)->AllGather(ports);  // (2 W,) rank-major
  if (!all_ports.ok()) return all_ports.status();
  const int cp_leader = cp_group * P, dp_leader = dp_group;
  cp.rendezvous = JoinHostPort(host_of(cp_leader), (*all_ports)[2 * cp_leader].item<int64_t>());
  dp.rendezvous = JoinHostPort(host_of(dp_leader), (*all_ports)[2 * dp_leader + 1].item<int64_t>());
  // Context groups first on every rank, then data groups: each join waits only for ranks that
  // are joining the same kind of group.
  auto join = [](const RankGroupOptions& o, std::unique_ptr<TcpCommunicator> star) {
    if (!star) return ChooseAndConnect(o, TcpCommunicator::Create(TcpOptions(o)));
    if (absl::Status s = star->Join(); !s.ok()) return absl::StatusOr<RankGroup>(s);
    return ChooseAndConnect(o, std::move(star));
  };
  absl::StatusOr<RankGroup> context = join(cp, std::move(cp_star));
  if (!context.ok())
    return absl::Status(context.status().code(), absl::StrCat("context-parallel group ", cp_group, ": ",
                                                              context.status().message()));
  absl::StatusOr<RankGroup> data = join(dp, std::move(dp_star));
  if (!data.ok())
    return absl::Status(data.status().code(),
                        absl::StrCat("data-parallel group ", dp_group, ": ", data.status().message()));
  layout.context = *std::move(context);
  layout.data = *std::move(data);
  return layout;
}

}  // namespace

bool RanksDidNotMeet(const absl::Status& status) { return status.GetPayload(kRanksDidNotMeet).has_value(); }

absl::StatusOr<RankGroup> ConnectRanks(const RankGroupOptions& options) {
  return MarkMeetingFailure(JoinRanks(options));
}

absl::StatusOr<RankLayout> ConnectRankLayout(const RankGroupOptions& options, int context_parallel) {
  return MarkMeetingFailure(JoinLayout(options, context_parallel));
}

}  // namespace odyssey::engine
