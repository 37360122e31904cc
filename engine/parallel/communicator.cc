#include "engine/parallel/communicator.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <map>

#include <torch/torch.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace odyssey::engine {

// ---------------------------------------------------------------------------------------------
// Grouping by dtype on top of the flat primitives.

namespace {

// Tensors of one dtype, in the order they were passed.
struct DtypeGroup {
  torch::Dtype dtype;
  std::vector<size_t> members;
};

std::vector<DtypeGroup> GroupByDtype(const std::vector<torch::Tensor>& tensors) {
  std::vector<DtypeGroup> groups;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].defined(), "communicator: tensor ", i, " is undefined");
    const torch::Dtype d = tensors[i].scalar_type();
    auto it = std::find_if(groups.begin(), groups.end(), [d](const DtypeGroup& g) { return g.dtype == d; });
    if (it == groups.end()) {
      groups.push_back({d, {}});
      it = groups.end() - 1;
    }
    it->members.push_back(i);
  }
  return groups;
}

// (N) contiguous CPU copy of the group's tensors, one after another.
torch::Tensor Flatten(const std::vector<torch::Tensor>& tensors, const DtypeGroup& g) {
  std::vector<torch::Tensor> parts;
  parts.reserve(g.members.size());
  for (size_t i : g.members) parts.push_back(tensors[i].detach().reshape({-1}).to(torch::kCPU));
  return torch::cat(parts).contiguous();
}

void Unflatten(const torch::Tensor& flat, std::vector<torch::Tensor>& tensors, const DtypeGroup& g) {
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (size_t i : g.members) {
    torch::Tensor& t = tensors[i];
    const int64_t n = t.numel();
    t.copy_(flat.slice(0, offset, offset + n).view(t.sizes()));
    offset += n;
  }
}

}  // namespace

absl::Status Communicator::AllReduce(std::vector<torch::Tensor>& tensors, ReduceOp op) {
  if (world_size() == 1) {
    return absl::OkStatus();  // the sum and the mean over one rank are the tensors themselves
  }
  for (const DtypeGroup& g : GroupByDtype(tensors)) {
    torch::Tensor flat = Flatten(tensors, g);
    if (flat.numel() == 0) continue;  // every rank has the same shapes, so every rank skips
    if (absl::Status s = AllReduceFlat(flat, op); !s.ok()) return s;
    Unflatten(flat, tensors, g);
  }
  return absl::OkStatus();
}

absl::Status Communicator::Broadcast(std::vector<torch::Tensor>& tensors, int root) {
  if (root < 0 || root >= world_size())
    return absl::InvalidArgumentError(absl::StrCat("broadcast root (", root, ") must be in [0, ", world_size(), ")"));
  if (world_size() == 1) return absl::OkStatus();
  for (const DtypeGroup& g : GroupByDtype(tensors)) {
    torch::Tensor flat = Flatten(tensors, g);
    if (flat.numel() == 0) continue;
    if (absl::Status s = BroadcastFlat(flat, root); !s.ok()) return s;
    if (rank() != root) Unflatten(flat, tensors, g);
  }
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> Communicator::AllToAll(const torch::Tensor& input, int64_t split_dim,
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
  if (P == 1) return input;  // one chunk, sent to itself
  // (P, chunk...) with chunk j the j-th slice along split_dim, as one contiguous CPU buffer.
  torch::Tensor send = input.detach().unflatten(split_dim, {P, input.size(split_dim) / P}).movedim(split_dim, 0);
  std::vector<int64_t> chunk(send.sizes().begin() + 1, send.sizes().end());
  torch::Tensor flat = send.to(torch::kCPU).contiguous().view({P, -1});  // (P, n)
  if (flat.data_ptr() == input.data_ptr()) flat = flat.clone();  // never write into the caller's tensor
  if (flat.numel() > 0)
    if (absl::Status s = AllToAllFlat(flat); !s.ok()) return s;
  // Row i came from rank i: (P, chunk...) -> chunk with dim concat_dim P times longer, rank-major.
  std::vector<int64_t> shape = {P};
  shape.insert(shape.end(), chunk.begin(), chunk.end());
  return flat.view(shape).movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1).to(input.device()).contiguous();
}

absl::StatusOr<torch::Tensor> Communicator::AllGather(const torch::Tensor& shard) {
  TORCH_CHECK(shard.defined(), "communicator: all-gather of an undefined tensor");
  const int64_t P = world_size();
  if (P == 1) return shard.reshape({-1});
  // Row j goes to rank j: every row is this rank's shard, so row i received is rank i's.
  torch::Tensor flat = shard.detach().reshape({1, -1}).to(torch::kCPU).expand({P, shard.numel()}).contiguous();  // (P, n)
  if (flat.numel() > 0)
    if (absl::Status s = AllToAllFlat(flat); !s.ok()) return s;
  return flat.view({-1}).to(shard.device());
}

std::unique_ptr<PendingCollective> Communicator::StartAllGather(const torch::Tensor& shard) {
  return std::make_unique<FinishedCollective>(AllGather(shard));
}

absl::StatusOr<torch::Tensor> Communicator::ReduceScatter(const torch::Tensor& full, ReduceOp op) {
  TORCH_CHECK(full.defined(), "communicator: reduce-scatter of an undefined tensor");
  const int64_t P = world_size();
  if (full.numel() % P != 0)
    return absl::InvalidArgumentError(absl::StrCat("reduce-scatter: world_size (", P,
                                                   ") must divide the tensor's element count (", full.numel(), ")"));
  if (P == 1) return full.reshape({-1});
  // The whole sum, then this rank's slice: the same bits as the slice of an AllReduce.
  torch::Tensor flat = full.detach().reshape({-1}).to(torch::kCPU).contiguous();  // (P n)
  if (flat.data_ptr() == full.data_ptr()) flat = flat.clone();  // never write into the caller's tensor
  const int64_t n = flat.numel() / P;
  if (flat.numel() > 0)
    if (absl::Status s = AllReduceFlat(flat, op); !s.ok()) return s;
  return flat.slice(0, rank() * n, (rank() + 1) * n).clone().to(full.device());
}

absl::Status Communicator::Barrier() {
  if (world_size() == 1) return absl::OkStatus();
  torch::Tensor one = torch::ones({1}, torch::kInt32);
  return AllReduceFlat(one, ReduceOp::kSum);
}

torch::Tensor ReduceInOrder(const std::vector<torch::Tensor>& inputs, ReduceOp op) {
  TORCH_CHECK(!inputs.empty(), "ReduceInOrder: no inputs");
  const torch::Dtype dtype = inputs[0].scalar_type();
  const bool widen = torch::isFloatingType(dtype) && c10::elementSize(dtype) < 4;
  torch::Tensor acc = widen ? inputs[0].to(torch::kFloat32) : inputs[0].clone();
  for (size_t i = 1; i < inputs.size(); ++i) acc.add_(inputs[i]);
  if (op == ReduceOp::kAvg) {
    const double n = static_cast<double>(inputs.size());
    acc = torch::isFloatingType(acc.scalar_type()) ? acc.div_(n) : acc.div(static_cast<int64_t>(n), "trunc");
  }
  return acc.to(dtype);
}

// ---------------------------------------------------------------------------------------------
// One rank.

absl::Status SingleRankCommunicator::AllReduceFlat(torch::Tensor& /*flat*/, ReduceOp /*op*/) {
  return absl::OkStatus();  // the sum and the mean over one rank are the tensor itself
}

absl::Status SingleRankCommunicator::BroadcastFlat(torch::Tensor& /*flat*/, int /*root*/) { return absl::OkStatus(); }

absl::Status SingleRankCommunicator::AllToAllFlat(torch::Tensor& /*flat*/) { return absl::OkStatus(); }

// ---------------------------------------------------------------------------------------------
// In-process group.

class InProcessCommunicator : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }

 protected:
  absl::Status AllReduceFlat(torch::Tensor& flat, ReduceOp op) override {
    return group_->Collective(rank_, flat,
                              [op](const std::vector<torch::Tensor>& in) { return ReduceInOrder(in, op); });
  }
  absl::Status BroadcastFlat(torch::Tensor& flat, int root) override {
    return group_->Collective(rank_, flat, [root](const std::vector<torch::Tensor>& in) { return in[root].clone(); });
  }
  absl::Status AllToAllFlat(torch::Tensor& flat) override {
    // result (P_from, P_to, n): rank r takes column r, one row per sender.
    return group_->Collective(
        rank_, flat, [](const std::vector<torch::Tensor>& in) { return torch::stack(in); },
        [](const torch::Tensor& result, int r) { return result.select(1, r); });
  }

 private:
  std::shared_ptr<InProcessGroup> group_;
  const int rank_;
};

std::shared_ptr<InProcessGroup> InProcessGroup::Create(int world_size, absl::Duration timeout) {
  TORCH_CHECK(world_size >= 1, "InProcessGroup: world_size (", world_size, ") must be >= 1");
  return std::shared_ptr<InProcessGroup>(new InProcessGroup(world_size, timeout));
}

InProcessGroup::InProcessGroup(int world_size, absl::Duration timeout)
    : world_size_(world_size), timeout_(timeout), inputs_(world_size) {}

std::unique_ptr<Communicator> InProcessGroup::Rank(int r) {
  TORCH_CHECK(r >= 0 && r < world_size_, "InProcessGroup: rank ", r, " out of [0, ", world_size_, ")");
  return std::make_unique<InProcessCommunicator>(shared_from_this(), r);
}

absl::Status InProcessGroup::Collective(
    int rank, torch::Tensor& flat, const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& combine,
    const std::function<torch::Tensor(const torch::Tensor&, int)>& part) {
  const absl::Time deadline = absl::Now() + timeout_;
  absl::MutexLock lock(&mu_);
  auto timed_out = [&](const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    failed_ = absl::DeadlineExceededError(absl::StrCat("in-process collective: rank ", rank, " timed out ", what));
    return failed_;
  };
  // Wait until the previous collective has been copied out by every rank.
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !failed_.ok() || !distributing_; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&drained), deadline))
    return timed_out("waiting for the previous collective to drain");
  if (!failed_.ok()) return failed_;
  const int64_t generation = generation_;
  inputs_[rank] = flat;
  if (++arrived_ == world_size_) {
    for (int r = 1; r < world_size_; ++r) {
      if (inputs_[r].sizes() != inputs_[0].sizes() || inputs_[r].scalar_type() != inputs_[0].scalar_type()) {
        failed_ = absl::InternalError(absl::StrCat("in-process collective: rank ", r, " passed ", inputs_[r].numel(),
                                                   " elements, rank 0 ", inputs_[0].numel()));
        return failed_;
      }
    }
    result_ = combine(inputs_);
    distributing_ = true;
  } else {
    auto ready = [this, generation]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !failed_.ok() || (distributing_ && generation_ == generation);
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline))
      return timed_out(absl::StrCat("waiting for ", world_size_ - arrived_, " other rank(s)"));
    if (!failed_.ok()) return failed_;
  }
  flat.copy_(part ? part(result_, rank) : result_);
  if (++departed_ == world_size_) {
    distributing_ = false;
    arrived_ = departed_ = 0;
    ++generation_;
    for (torch::Tensor& t : inputs_) t = torch::Tensor();
    result_ = torch::Tensor();
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// TCP star.

absl::Status ParseHostPort(const std::string& address, const std::string& field, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0)
    return absl::InvalidArgumentError(absl::StrCat(field, " '", address, "' must be host:port"));
  int p = -1;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &p) || p < 0 || p > 65535)
    return absl::InvalidArgumentError(absl::StrCat(field, " '", address, "': port must be in [0, 65535]"));
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  *port = p;
  return absl::OkStatus();
}

namespace {

constexpr uint32_t kMagic = 0x6f647973;  // "odys"
enum : uint32_t { kOpHello = 1, kOpAllReduce = 2, kOpBroadcast = 3, kOpAllToAll = 4 };

struct Header {
  uint32_t magic;
  uint32_t op;
  uint64_t seq;
  uint64_t bytes;
  int32_t dtype;
  int32_t rank;
};

absl::Status Errno(const std::string& what) { return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno))); }

int RemainingMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

// Waits until fd is readable (POLLIN) or writable (POLLOUT) before the deadline.
absl::Status WaitFd(int fd, short events, absl::Time deadline, const std::string& what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, RemainingMs(deadline));
    if (n > 0) return absl::OkStatus();
    if (n == 0) return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    if (errno != EINTR) return Errno(what);
  }
}

// WaitFd in slices of 100 ms, asking `aborted` between them: CANCELLED (`cancelled`) once it
// says so, DEADLINE_EXCEEDED at the deadline.
absl::Status WaitFdAbortable(int fd, short events, absl::Time deadline, const std::string& what,
                             const std::function<bool()>& aborted, const absl::Status& cancelled) {
  for (;;) {
    if (aborted()) return cancelled;
    absl::Status waited = WaitFd(fd, events, std::min(deadline, absl::Now() + absl::Milliseconds(100)), what);
    if (absl::IsDeadlineExceeded(waited) && absl::Now() < deadline) continue;
    return waited;
  }
}

absl::Status SendAll(int fd, const void* data, size_t n, absl::Time deadline, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (absl::Status s = WaitFd(fd, POLLOUT, deadline, what); !s.ok()) return s;
    } else if (k < 0 && errno != EINTR) {
      return Errno(what);
    }
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, void* data, size_t n, absl::Time deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k == 0) {
      return absl::UnavailableError(absl::StrCat(what, ": the peer closed the connection"));
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (absl::Status s = WaitFd(fd, POLLIN, deadline, what); !s.ok()) return s;
    } else if (errno != EINTR) {
      return Errno(what);
    }
  }
  return absl::OkStatus();
}

void SetNoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

absl::StatusOr<addrinfo*> Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) return absl::UnavailableError(absl::StrCat("rendezvous host '", host, "': ", gai_strerror(rc)));
  return res;
}

// The numeric host of a peer's address ("10.1.2.3", "::1"; an IPv4-mapped IPv6 address in its
// IPv4 form); empty when it cannot be printed.
std::string NumericHost(const sockaddr_storage& addr, socklen_t len) {
  char host[NI_MAXHOST] = {};
  if (::getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0)
    return "";
  absl::string_view h = host;
  absl::ConsumePrefix(&h, "::ffff:");
  return std::string(h);
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpCommunicator>> TcpCommunicator::Listen(const TcpCommunicatorOptions& options) {
  if (options.world_size < 1)
    return absl::InvalidArgumentError(absl::StrCat("world_size (", options.world_size, ") must be >= 1"));
  if (options.rank < 0 || options.rank >= options.world_size)
    return absl::InvalidArgumentError(
        absl::StrCat("rank (", options.rank, ") must be in [0, world_size (", options.world_size, "))"));
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(options.rendezvous, "rendezvous", &host, &port); !s.ok()) return s;
  std::unique_ptr<TcpCommunicator> c(new TcpCommunicator(options));
  if (options.rank != 0) return c;
  absl::StatusOr<addrinfo*> res = Resolve(host, port, /*passive=*/true);
  if (!res.ok()) return res.status();
  absl::Status last = absl::UnavailableError(absl::StrCat("rendezvous ", options.rendezvous, ": no address"));
  for (addrinfo* a = *res; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last = Errno("socket");
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      last = Errno(absl::StrCat("rendezvous ", options.rendezvous, ": bind/listen"));
      ::close(fd);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    c->bound_port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                       : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    c->listen_fd_ = fd;
    break;
  }
  ::freeaddrinfo(*res);
  if (c->listen_fd_ < 0) return last;
  return c;
}

// How long rank 0 waits for a connected client's hello before dropping it.
constexpr absl::Duration kHelloWait = absl::Seconds(5);

absl::Status TcpCommunicator::Join() {
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  auto aborted = [this] { return options_.abort && options_.abort(); };
  const absl::Status cancelled = absl::CancelledError(absl::StrCat("rendezvous ", options_.rendezvous, ": aborted"));
  const int W = options_.world_size;
  if (W == 1) return absl::OkStatus();
  if (options_.rank == 0) {
    peers_.assign(W, -1);
    peer_hosts_.assign(W, "");
    std::string host;
    int port = 0;
    if (absl::Status s = ParseHostPort(options_.rendezvous, "rendezvous", &host, &port); !s.ok()) return s;
    peer_hosts_[0] = host;
    for (int joined = 1; joined < W;) {
      // Waits in slices so that an abort is noticed.
      absl::Status waited =
          WaitFdAbortable(listen_fd_, POLLIN, deadline, absl::StrCat("rendezvous: waiting for ", W - joined,
                                                                     " rank(s) to join"), aborted, cancelled);
      if (!waited.ok()) return waited;
      sockaddr_storage from{};
      socklen_t from_len = sizeof(from);
      const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &from_len, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
        return Errno("rendezvous: accept");
      }
      SetNoDelay(fd);
      Header h{};
      // A client that connects and says nothing (not a rank) is dropped after a few seconds, so
      // that it cannot hold the ranks that come after it until the deadline.
      const absl::Time hello_by = std::min(deadline, absl::Now() + kHelloWait);
      absl::Status s = WaitFdAbortable(fd, POLLIN, hello_by, "rendezvous: hello", aborted, cancelled);
      if (absl::IsCancelled(s)) {
        ::close(fd);
        return s;
      }
      if (s.ok()) s = RecvAll(fd, &h, sizeof(h), hello_by, "rendezvous: hello");
      if (s.ok() && (h.magic != kMagic || h.op != kOpHello || h.rank <= 0 || h.rank >= W || peers_[h.rank] != -1 ||
                     static_cast<int>(h.bytes) != W))
        s = absl::InternalError(absl::StrCat("rendezvous: bad hello (rank ", h.rank, ", world_size ", h.bytes, ")"));
      if (!s.ok()) {
        ::close(fd);  // a stray or confused client must not take a rank's place
        continue;
      }
      peers_[h.rank] = fd;
      peer_hosts_[h.rank] = NumericHost(from, from_len);
      ++joined;
    }
    // Tell every rank that the group is complete.
    for (int r = 1; r < W; ++r) {
      Header ok{kMagic, kOpHello, 0, static_cast<uint64_t>(W), 0, 0};
      if (absl::Status s = SendAll(peers_[r], &ok, sizeof(ok), deadline, "rendezvous: welcome"); !s.ok()) return s;
    }
    ::close(listen_fd_);
    listen_fd_ = -1;
    return absl::OkStatus();
  }
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(options_.rendezvous, "rendezvous", &host, &port); !s.ok()) return s;
  // Rank 0 may not be listening yet: retry until the deadline.
  absl::Status last = absl::DeadlineExceededError(absl::StrCat("rendezvous ", options_.rendezvous, ": timed out"));
  absl::Duration backoff = absl::Milliseconds(20);
  while (absl::Now() < deadline) {
    if (aborted()) return cancelled;
    absl::StatusOr<addrinfo*> res = Resolve(host, port, /*passive=*/false);
    if (!res.ok()) return res.status();
    int fd = -1;
    for (addrinfo* a = *res; a != nullptr && fd < 0; a = a->ai_next) {
      fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
        last = Errno(absl::StrCat("rendezvous ", options_.rendezvous, ": connect"));
        ::close(fd);
        fd = -1;
      }
    }
    ::freeaddrinfo(*res);
    if (fd >= 0) {
      SetNoDelay(fd);
      Header hello{kMagic, kOpHello, 0, static_cast<uint64_t>(W), 0, options_.rank};
      Header welcome{};
      absl::Status s = SendAll(fd, &hello, sizeof(hello), deadline, "rendezvous: hello");
      // The welcome comes once every rank has joined, which may take long: the wait asks the
      // abort, so a cancelled job's rank stops at once (also when what answered the connection
      // was not rank 0 but a process holding the port, which never welcomes).
      if (s.ok()) s = WaitFdAbortable(fd, POLLIN, deadline, "rendezvous: welcome", aborted, cancelled);
      if (absl::IsCancelled(s)) {
        ::close(fd);
        return s;
      }
      if (s.ok()) s = RecvAll(fd, &welcome, sizeof(welcome), deadline, "rendezvous: welcome");
      if (s.ok() && (welcome.magic != kMagic || welcome.op != kOpHello))
        s = absl::InternalError("rendezvous: bad welcome from rank 0");
      if (s.ok()) {
        peers_ = {fd};
        return absl::OkStatus();
      }
      ::close(fd);
      last = s;
    }
    absl::SleepFor(std::min(backoff, deadline - absl::Now()));  // retry pacing, not a wait on a condition
    backoff = std::min(backoff * 2, absl::Milliseconds(500));
  }
  return last;
}

absl::StatusOr<std::unique_ptr<TcpCommunicator>> TcpCommunicator::Create(const TcpCommunicatorOptions& options) {
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> c = Listen(options);
  if (!c.ok()) return c.status();
  if (absl::Status s = (*c)->Join(); !s.ok()) return s;
  return c;
}

TcpCommunicator::~TcpCommunicator() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
  for (int fd : peers_)
    if (fd >= 0) ::close(fd);
}

absl::Status TcpCommunicator::SendTensor(int fd, uint32_t op, const torch::Tensor& flat) {
  const absl::Time deadline = absl::Now() + options_.op_timeout;
  Header h{kMagic, op, seq_, static_cast<uint64_t>(flat.nbytes()), static_cast<int32_t>(flat.scalar_type()),
           options_.rank};
  if (absl::Status s = SendAll(fd, &h, sizeof(h), deadline, "collective send"); !s.ok()) return s;
  return SendAll(fd, flat.data_ptr(), flat.nbytes(), deadline, "collective send");
}

absl::Status TcpCommunicator::RecvTensor(int fd, uint32_t op, torch::Tensor& flat) {
  const absl::Time deadline = absl::Now() + options_.op_timeout;
  Header h{};
  if (absl::Status s = RecvAll(fd, &h, sizeof(h), deadline, "collective receive"); !s.ok()) return s;
  if (h.magic != kMagic || h.op != op || h.seq != seq_ || h.bytes != flat.nbytes() ||
      h.dtype != static_cast<int32_t>(flat.scalar_type()))
    return absl::InternalError(absl::StrCat("collective #", seq_, ": rank ", h.rank, " sent op ", h.op, " #", h.seq,
                                            " of ", h.bytes, " bytes; expected op ", op, " of ", flat.nbytes(),
                                            " bytes (ranks called different collectives)"));
  return RecvAll(fd, flat.data_ptr(), flat.nbytes(), deadline, "collective receive");
}

absl::Status TcpCommunicator::AllReduceFlat(torch::Tensor& flat, ReduceOp op) {
  ++seq_;
  if (options_.rank != 0) {
    if (absl::Status s = SendTensor(peers_[0], kOpAllReduce, flat); !s.ok()) return s;
    return RecvTensor(peers_[0], kOpAllReduce, flat);
  }
  std::vector<torch::Tensor> inputs = {flat};
  for (int r = 1; r < options_.world_size; ++r) {
    inputs.push_back(torch::empty_like(flat));
    if (absl::Status s = RecvTensor(peers_[r], kOpAllReduce, inputs.back()); !s.ok()) return s;
  }
  flat.copy_(ReduceInOrder(inputs, op));
  for (int r = 1; r < options_.world_size; ++r)
    if (absl::Status s = SendTensor(peers_[r], kOpAllReduce, flat); !s.ok()) return s;
  return absl::OkStatus();
}

absl::Status TcpCommunicator::BroadcastFlat(torch::Tensor& flat, int root) {
  ++seq_;
  if (options_.rank != 0) {
    if (options_.rank == root) return SendTensor(peers_[0], kOpBroadcast, flat);
    return RecvTensor(peers_[0], kOpBroadcast, flat);
  }
  if (root != 0)
    if (absl::Status s = RecvTensor(peers_[root], kOpBroadcast, flat); !s.ok()) return s;
  for (int r = 1; r < options_.world_size; ++r) {
    if (r == root) continue;
    if (absl::Status s = SendTensor(peers_[r], kOpBroadcast, flat); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::AllToAllFlat(torch::Tensor& flat) {
  ++seq_;
  if (options_.rank != 0) {
    if (absl::Status s = SendTensor(peers_[0], kOpAllToAll, flat); !s.ok()) return s;
    return RecvTensor(peers_[0], kOpAllToAll, flat);
  }
  const int P = options_.world_size;
  std::vector<torch::Tensor> inputs = {flat.clone()};  // (P, n) per sender
  for (int r = 1; r < P; ++r) {
    inputs.push_back(torch::empty_like(flat));
    if (absl::Status s = RecvTensor(peers_[r], kOpAllToAll, inputs.back()); !s.ok()) return s;
  }
  torch::Tensor all = torch::stack(inputs);  // (P_from, P_to, n)
  for (int r = 1; r < P; ++r) {
    if (absl::Status s = SendTensor(peers_[r], kOpAllToAll, all.select(1, r).contiguous()); !s.ok()) return s;
  }
  flat.copy_(all.select(1, 0));
  return absl::OkStatus();
}

}  // namespace odyssey::engine
