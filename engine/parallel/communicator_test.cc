#include "engine/parallel/communicator.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace odyssey::engine {
namespace {

// Awkward sizes and mixed dtypes: every rank's list of tensors, seeded by rank (a generator of
// its own: rank threads call this concurrently).
std::vector<torch::Tensor> RankTensors(int rank) {
  at::Generator gen = at::detail::createCPUGenerator(1000 + rank);
  return {
      torch::randn({97}, gen),
      torch::randn({7, 13}, gen, torch::kFloat64),
      torch::randn({257}, gen).to(torch::kBFloat16),
      torch::randint(-1000, 1000, {1025}, gen, torch::kInt64),
      torch::randn({3, 1, 5}, gen),
      torch::randn({0}, gen),  // empty: skipped by every rank alike
  };
}

// The sum computed directly (fp32 for bf16, as the communicator promises), in the same order.
std::vector<torch::Tensor> DirectSum(int world_size) {
  std::vector<torch::Tensor> sum;
  for (int r = 0; r < world_size; ++r) {
    std::vector<torch::Tensor> t = RankTensors(r);
    if (r == 0) {
      for (auto& x : t) sum.push_back(x.scalar_type() == torch::kBFloat16 ? x.to(torch::kFloat32) : x.clone());
    } else {
      for (size_t i = 0; i < t.size(); ++i) sum[i] += t[i];
    }
  }
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = sum[i].to(RankTensors(0)[i].scalar_type());
  return sum;
}

void ExpectEqualLists(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, int rank) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].scalar_type(), want[i].scalar_type()) << "rank " << rank << " tensor " << i;
    EXPECT_TRUE(torch::equal(got[i], want[i])) << "rank " << rank << " tensor " << i;
  }
}

// Runs fn(comm) on every rank's thread and returns when all are done.
void RunRanks(std::vector<std::unique_ptr<Communicator>>& comms,
              const std::function<void(Communicator&)>& fn) {
  std::vector<std::thread> threads;
  for (auto& c : comms) threads.emplace_back([&fn, &c] { fn(*c); });
  for (auto& t : threads) t.join();
}

std::vector<std::unique_ptr<Communicator>> InProcess(int world_size) {
  auto group = InProcessGroup::Create(world_size);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < world_size; ++r) comms.push_back(group->Rank(r));
  return comms;
}

std::vector<std::unique_ptr<Communicator>> Tcp(int world_size) {
  TcpCommunicatorOptions o;
  o.rendezvous = "127.0.0.1:0";
  o.world_size = world_size;
  o.connect_timeout = absl::Seconds(30);
  auto root = TcpCommunicator::Listen(o);
  EXPECT_TRUE(root.ok()) << root.status();
  o.rendezvous = "127.0.0.1:" + std::to_string((*root)->bound_port());
  std::vector<std::unique_ptr<Communicator>> comms(world_size);
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    EXPECT_TRUE((*root)->Join().ok());
    comms[0] = *std::move(root);
  });
  for (int r = 1; r < world_size; ++r) {
    threads.emplace_back([&comms, o, r] {
      TcpCommunicatorOptions mine = o;
      mine.rank = r;
      auto c = TcpCommunicator::Create(mine);
      EXPECT_TRUE(c.ok()) << c.status();
      if (c.ok()) comms[r] = *std::move(c);
    });
  }
  for (auto& t : threads) t.join();
  return comms;
}

class CommunicatorTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::vector<std::unique_ptr<Communicator>> Make(int world_size) {
    return GetParam() == "tcp" ? Tcp(world_size) : InProcess(world_size);
  }
};

TEST_P(CommunicatorTest, AllReduceSumEqualsDirectSum) {
  for (int world_size : {1, 2, 3}) {
    auto comms = Make(world_size);
    const std::vector<torch::Tensor> want = DirectSum(world_size);
    RunRanks(comms, [&](Communicator& c) {
      std::vector<torch::Tensor> t = RankTensors(c.rank());
      ASSERT_TRUE(c.AllReduce(t, ReduceOp::kSum).ok());
      ExpectEqualLists(t, want, c.rank());
    });
  }
}

TEST_P(CommunicatorTest, AllReduceAvgIsSumOverWorldSize) {
  auto comms = Make(3);
  std::vector<torch::Tensor> want = DirectSum(3);
  RunRanks(comms, [&](Communicator& c) {
    std::vector<torch::Tensor> t = {RankTensors(c.rank())[0]};
    ASSERT_TRUE(c.AllReduce(t, ReduceOp::kAvg).ok());
    EXPECT_TRUE(torch::equal(t[0], want[0] / 3.0)) << "rank " << c.rank();
  });
}

// A few megabytes, so a message takes many partial socket reads and writes.
TEST_P(CommunicatorTest, AllReduceLargeTensor) {
  auto comms = Make(2);
  const int64_t n = 3 * 1000 * 1000 + 7;
  RunRanks(comms, [&](Communicator& c) {
    std::vector<torch::Tensor> t = {torch::full({n}, static_cast<float>(c.rank() + 1))};
    ASSERT_TRUE(c.AllReduce(t).ok());
    EXPECT_TRUE(torch::equal(t[0], torch::full({n}, 3.0f))) << "rank " << c.rank();
  });
}

TEST_P(CommunicatorTest, BroadcastFromEveryRootAndBarrier) {
  auto comms = Make(3);
  for (int root = 0; root < 3; ++root) {
    RunRanks(comms, [&](Communicator& c) {
      std::vector<torch::Tensor> t = RankTensors(c.rank());
      ASSERT_TRUE(c.Broadcast(t, root).ok());
      ExpectEqualLists(t, RankTensors(root), c.rank());
      ASSERT_TRUE(c.Barrier().ok());
    });
  }
}

// Rank r's all-to-all input: the same shape on every rank, values drawn per rank, so a
// misrouted chunk shows.
torch::Tensor AllToAllInput(int rank, torch::Dtype dtype) {
  at::Generator gen = at::detail::createCPUGenerator(2000 + rank);
  return torch::randint(-1000, 1000, {2, 6, 3, 5}, gen, torch::kInt64).to(dtype);  // (B, H, S, D)
}

TEST_P(CommunicatorTest, AllToAllSendsChunkJToRankJInRankOrder) {
  for (int world_size : {1, 2, 3}) {
    auto comms = Make(world_size);
    for (torch::Dtype dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat64, torch::kInt64}) {
      // The layout change written out: rank j gets chunk j of every rank's heads, senders in
      // rank order along the sequence.
      std::vector<torch::Tensor> want(world_size), back(world_size);
      for (int j = 0; j < world_size; ++j) {
        std::vector<torch::Tensor> parts;
        for (int i = 0; i < world_size; ++i) parts.push_back(AllToAllInput(i, dtype).chunk(world_size, 1)[j]);
        want[j] = torch::cat(parts, 2);  // (2, 6/P, 3P, 5)
      }
      RunRanks(comms, [&](Communicator& c) {
        const torch::Tensor x = AllToAllInput(c.rank(), dtype);
        absl::StatusOr<torch::Tensor> y = c.AllToAll(x, /*split_dim=*/1, /*concat_dim=*/2);
        ASSERT_TRUE(y.ok()) << y.status();
        EXPECT_EQ(y->scalar_type(), dtype);
        EXPECT_EQ(y->sizes(), want[c.rank()].sizes()) << "rank " << c.rank();
        EXPECT_TRUE(torch::equal(*y, want[c.rank()])) << "rank " << c.rank() << " P " << world_size;
        // The inverse layout change restores every rank's input; the input itself is untouched.
        absl::StatusOr<torch::Tensor> z = c.AllToAll(*y, /*split_dim=*/2, /*concat_dim=*/1);
        ASSERT_TRUE(z.ok()) << z.status();
        EXPECT_TRUE(torch::equal(*z, x)) << "rank " << c.rank();
        EXPECT_TRUE(torch::equal(x, AllToAllInput(c.rank(), dtype)));
      });
    }
  }
}

// Split and concatenation along the same dim (a transpose of the ranks' chunks), the leading
// dim, and a non-contiguous input.
TEST_P(CommunicatorTest, AllToAllOtherDimsAndStridedInput) {
  auto comms = Make(2);
  RunRanks(comms, [&](Communicator& c) {
    const torch::Tensor x = AllToAllInput(c.rank(), torch::kFloat32).transpose(1, 3);  // (2, 5, 3, 6) strided
    absl::StatusOr<torch::Tensor> y = c.AllToAll(x, 0, 0);
    ASSERT_TRUE(y.ok()) << y.status();
    const torch::Tensor a = AllToAllInput(0, torch::kFloat32).transpose(1, 3);
    const torch::Tensor b = AllToAllInput(1, torch::kFloat32).transpose(1, 3);
    const int r = c.rank();
    EXPECT_TRUE(torch::equal(*y, torch::cat({a.narrow(0, r, 1), b.narrow(0, r, 1)}, 0))) << "rank " << r;
    absl::StatusOr<torch::Tensor> w = c.AllToAll(x, 3, 1);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(torch::equal(*w, torch::cat({a.narrow(3, 3 * r, 3), b.narrow(3, 3 * r, 3)}, 1))) << "rank " << r;
  });
}

TEST_P(CommunicatorTest, AllToAllRefusesASplitTheRanksDoNotDivide) {
  auto comms = Make(2);
  RunRanks(comms, [&](Communicator& c) {
    absl::StatusOr<torch::Tensor> y = c.AllToAll(torch::ones({2, 3, 4}), 1, 2);
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(y.status().message().find("world_size (2) must divide dim 1 of the input (3)"), std::string::npos)
        << y.status();
    EXPECT_EQ(c.AllToAll(torch::ones({2, 4}), 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(c.Barrier().ok());  // the refusals sent nothing: the group still works
  });
}

// All-gather returns the ranks' shards in rank order (any shape, any dtype, bytes as they are);
// reduce-scatter gives each rank its slice of the sum, the bits an all-reduce would give.
TEST_P(CommunicatorTest, AllGatherAndReduceScatter) {
  for (int world_size : {1, 3}) {
    auto comms = Make(world_size);
    std::vector<torch::Tensor> shards, fulls;
    for (int r = 0; r < world_size; ++r) {
      shards.push_back(RankTensors(r)[2].slice(0, 0, 7).view({7}));   // bf16 (7,)
      fulls.push_back(RankTensors(r)[2].slice(0, 0, 6 * world_size));  // bf16: fp32 accumulation
    }
    std::vector<torch::Tensor> want_sum = {torch::zeros({6 * world_size}, torch::kFloat32)};
    for (const auto& f : fulls) want_sum[0] += f.to(torch::kFloat32);
    RunRanks(comms, [&](Communicator& c) {
      const int r = c.rank();
      absl::StatusOr<torch::Tensor> g = c.AllGather(shards[static_cast<size_t>(r)]);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_TRUE(torch::equal(*g, torch::cat(shards))) << "rank " << r;
      absl::StatusOr<torch::Tensor> later = c.StartAllGather(shards[static_cast<size_t>(r)].view({1, 7}))->Wait();
      ASSERT_TRUE(later.ok()) << later.status();
      EXPECT_TRUE(torch::equal(*later, torch::cat(shards))) << "rank " << r;
      absl::StatusOr<torch::Tensor> mine = c.ReduceScatter(fulls[static_cast<size_t>(r)].view({world_size, 6}));
      ASSERT_TRUE(mine.ok()) << mine.status();
      EXPECT_TRUE(torch::equal(*mine, want_sum[0].to(torch::kBFloat16).slice(0, 6 * r, 6 * (r + 1)))) << "rank " << r;
      if (world_size > 1) {
        absl::StatusOr<torch::Tensor> bad = c.ReduceScatter(torch::ones({4}));
        EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_NE(bad.status().message().find("world_size (3) must divide the tensor's element count (4)"),
                  std::string::npos)
            << bad.status();
        ASSERT_TRUE(c.Barrier().ok());  // the refusal sent nothing
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Impl, CommunicatorTest, ::testing::Values("in_process", "tcp"),
                         [](const auto& info) { return info.param; });

TEST(TcpCommunicatorTest, PeerGoneFailsInsteadOfHanging) {
  auto comms = Tcp(2);
  comms[1].reset();  // rank 1's process "dies": its socket closes
  std::vector<torch::Tensor> t = {torch::ones({5})};
  absl::Status s = comms[0]->AllReduce(t);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST(TcpCommunicatorTest, MismatchedCollectivesAreReported) {
  auto comms = Tcp(2);
  absl::Status s0, s1;
  std::thread t1([&] {
    std::vector<torch::Tensor> t = {torch::ones({5})};
    s1 = comms[1]->AllReduce(t);
  });
  std::vector<torch::Tensor> t = {torch::ones({6})};
  s0 = comms[0]->AllReduce(t);
  comms[0].reset();  // unblocks rank 1, which waits for a reply that will not come
  t1.join();
  EXPECT_EQ(s0.code(), absl::StatusCode::kInternal) << s0;
  EXPECT_NE(s0.message().find("ranks called different collectives"), std::string::npos) << s0;
  EXPECT_FALSE(s1.ok());
}

TEST(TcpCommunicatorTest, BadOptionsNameTheField) {
  TcpCommunicatorOptions o;
  o.rendezvous = "localhost";
  o.world_size = 2;
  EXPECT_NE(TcpCommunicator::Create(o).status().message().find("rendezvous 'localhost' must be host:port"),
            std::string::npos);
  o.rendezvous = "127.0.0.1:0";
  o.rank = 2;
  EXPECT_NE(TcpCommunicator::Create(o).status().message().find("rank (2) must be in [0, world_size (2))"),
            std::string::npos);
}

// A rank waiting for peers that never come gives up when told to (a cancelled job), on either
// side of the rendezvous.
TEST(TcpCommunicatorTest, AbortEndsTheRendezvous) {
  TcpCommunicatorOptions o;
  o.rendezvous = "127.0.0.1:0";
  o.world_size = 2;
  int calls = 0;
  o.abort = [&calls] { return ++calls >= 3; };  // true on the third look
  auto root = TcpCommunicator::Create(o);
  EXPECT_EQ(root.status().code(), absl::StatusCode::kCancelled) << root.status();
  EXPECT_EQ(calls, 3);

  TcpCommunicatorOptions one;
  one.rendezvous = "127.0.0.1:0";
  auto listener = TcpCommunicator::Listen(one);
  ASSERT_TRUE(listener.ok());
  // Nobody hosts this port's rendezvous protocol once the listener is gone: rank 1 retries.
  const int port = (*listener)->bound_port();
  listener->reset();
  o.rendezvous = "127.0.0.1:" + std::to_string(port);
  o.rank = 1;
  calls = 0;
  auto peer = TcpCommunicator::Create(o);
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kCancelled) << peer.status();
}

// A loopback TCP socket: listening on a free port (listen), or connected to `port`; -1 on failure.
int LoopbackSocket(bool listen, int port = 0) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = listen ? ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && ::listen(fd, 4) == 0
                         : ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  if (!ok) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int PortOf(int fd) {
  sockaddr_in a{};
  socklen_t n = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return ntohs(a.sin_port);
}

// Rank 1 whose connection is answered by a process that holds the port and never welcomes (a
// stale rank 0, anything else bound there) stops as soon as its abort says so: before, it waited
// for the welcome until connect_timeout, and a cancelled job kept its worker that long.
TEST(TcpCommunicatorTest, AWelcomeThatNeverComesEndsOnAbort) {
  const int squatter = LoopbackSocket(/*listen=*/true);
  ASSERT_GE(squatter, 0);
  TcpCommunicatorOptions o;
  o.rendezvous = "127.0.0.1:" + std::to_string(PortOf(squatter));
  o.rank = 1;
  o.world_size = 2;
  o.connect_timeout = absl::Seconds(60);
  const auto start = std::chrono::steady_clock::now();
  o.abort = [&start] { return std::chrono::steady_clock::now() - start > std::chrono::milliseconds(300); };
  auto peer = TcpCommunicator::Create(o);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kCancelled) << peer.status();
  EXPECT_LT(seconds, 5.0);
  ::close(squatter);
}

// A client that connects to rank 0's rendezvous and says nothing is dropped after a few seconds;
// the real rank that comes after it still joins, and the group works.
TEST(TcpCommunicatorTest, ASilentClientDoesNotHoldTheRendezvous) {
  TcpCommunicatorOptions o;
  o.rendezvous = "127.0.0.1:0";
  o.world_size = 2;
  o.connect_timeout = absl::Seconds(60);
  auto root = TcpCommunicator::Listen(o);
  ASSERT_TRUE(root.ok()) << root.status();
  const int port = (*root)->bound_port();
  const int silent = LoopbackSocket(/*listen=*/false, port);
  ASSERT_GE(silent, 0);
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> peer = absl::UnknownError("not run");
  std::thread rank1([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // after the silent client
    TcpCommunicatorOptions p = o;
    p.rendezvous = "127.0.0.1:" + std::to_string(port);
    p.rank = 1;
    peer = TcpCommunicator::Create(p);
  });
  const auto start = std::chrono::steady_clock::now();
  const absl::Status joined = (*root)->Join();
  rank1.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(joined.ok()) << joined;
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_LT(seconds, 30.0);
  std::vector<torch::Tensor> t0 = {torch::ones({3})}, t1 = {torch::full({3}, 2.0)};
  std::thread reduce1([&] { EXPECT_TRUE((*peer)->AllReduce(t1).ok()); });
  EXPECT_TRUE((*root)->AllReduce(t0).ok());
  reduce1.join();
  EXPECT_TRUE(torch::equal(t0[0], torch::full({3}, 3.0)));
  ::close(silent);
}

// One rank: every collective leaves the tensors bitwise as they were, in place (no staging
// copy), bf16 and empty tensors included; a broadcast root other than 0 is refused.
TEST(SingleRankCommunicatorTest, CollectivesAreIdentities) {
  SingleRankCommunicator c;
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.world_size(), 1);
  const std::vector<torch::Tensor> want = RankTensors(0);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    std::vector<torch::Tensor> t = RankTensors(0);
    const void* storage = t[0].data_ptr();
    ASSERT_TRUE(c.AllReduce(t, op).ok());
    ExpectEqualLists(t, want, 0);
    EXPECT_EQ(t[0].data_ptr(), storage);
  }
  std::vector<torch::Tensor> t = RankTensors(0);
  ASSERT_TRUE(c.Broadcast(t, 0).ok());
  ExpectEqualLists(t, want, 0);
  EXPECT_EQ(c.Broadcast(t, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(c.Barrier().ok());
}

TEST(InProcessGroupTest, MissingRankTimesOut) {
  auto group = InProcessGroup::Create(2, absl::Milliseconds(100));
  auto c0 = group->Rank(0);
  std::vector<torch::Tensor> t = {torch::ones({3})};
  EXPECT_EQ(c0->AllReduce(t).code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(InProcessGroupTest, AllToAllWithAMissingRankTimesOut) {
  auto group = InProcessGroup::Create(2, absl::Milliseconds(100));
  auto c0 = group->Rank(0);
  EXPECT_EQ(c0->AllToAll(torch::ones({2, 4}), 0, 1).status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(TcpCommunicatorTest, AllToAllWithPeerGoneFailsInsteadOfHanging) {
  auto comms = Tcp(2);
  comms[1].reset();
  EXPECT_EQ(comms[0]->AllToAll(torch::ones({2, 4}), 0, 1).status().code(), absl::StatusCode::kUnavailable);
}

// One rank: the all-to-all is the input itself (no copy).
TEST(SingleRankCommunicatorTest, AllToAllIsTheInput) {
  SingleRankCommunicator c;
  const torch::Tensor x = torch::randn({2, 3, 4});
  absl::StatusOr<torch::Tensor> y = c.AllToAll(x, 1, 2);
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(y->data_ptr(), x.data_ptr());
}

}  // namespace
}  // namespace odyssey::engine
