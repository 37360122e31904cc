// ConnectRanks and ChooseBackend: NCCL only where every rank holds a GPU of its own, the TCP
// star otherwise; the group a rank gets works, and all ranks reach the same choice.
#include "engine/parallel/rank_group.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace odyssey::engine {
namespace {

RankPlace Gpu(uint64_t host, uint64_t uuid) { return {host, true, 7, uuid}; }

TEST(ChooseBackendTest, NcclOnlyWhenEveryRankHoldsItsOwnGpu) {
  EXPECT_EQ(ChooseBackend({Gpu(1, 10), Gpu(1, 11)}, true).backend, CollectiveBackend::kNccl);
  // Two hosts whose GPUs happen to carry the same UUID bytes in this test: distinct places.
  EXPECT_EQ(ChooseBackend({Gpu(1, 10), Gpu(2, 10)}, true).backend, CollectiveBackend::kNccl);

  BackendChoice shared = ChooseBackend({Gpu(1, 10), Gpu(1, 11), Gpu(1, 10)}, true);
  EXPECT_EQ(shared.backend, CollectiveBackend::kTcp);
  EXPECT_EQ(shared.reason, "ranks 0 and 2 share one GPU (NCCL needs a GPU per rank)");

  BackendChoice cpu = ChooseBackend({Gpu(1, 10), RankPlace{1, false, 0, 0}}, true);
  EXPECT_EQ(cpu.backend, CollectiveBackend::kTcp);
  EXPECT_EQ(cpu.reason, "rank 1 computes on the CPU");

  BackendChoice unbuilt = ChooseBackend({Gpu(1, 10), Gpu(1, 11)}, false);
  EXPECT_EQ(unbuilt.backend, CollectiveBackend::kTcp);
  EXPECT_EQ(unbuilt.reason, "this build has no NCCL");

  EXPECT_EQ(ChooseBackend({Gpu(1, 10)}, true).backend, CollectiveBackend::kTcp);
  EXPECT_STREQ(BackendName(CollectiveBackend::kNccl), "nccl");
  EXPECT_STREQ(BackendName(CollectiveBackend::kTcp), "tcp");
}


// P ranks in threads, rank r on device_of(r); each sums its rank + 1 over the group.
void ExpectGroupWorks(int P, const std::function<torch::Device(int)>& device_of, CollectiveBackend want, const std::string& want_reason) {
  const std::string rendezvous = "127.0.0.1:" + std::to_string(*FreePort(/*loopback=*/true));
  std::vector<absl::StatusOr<RankGroup>> groups(static_cast<size_t>(P));  // UNKNOWN until run
  std::vector<torch::Tensor> sums(static_cast<size_t>(P));
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      RankGroupOptions o;
      o.rendezvous = rendezvous;
      o.rank = r;
      o.world_size = P;
      o.device = device_of(r);
      o.connect_timeout = absl::Seconds(60);
      groups[static_cast<size_t>(r)] = ConnectRanks(o);
      if (!groups[static_cast<size_t>(r)].ok()) return;
      std::vector<torch::Tensor> t = {torch::full({3}, static_cast<double>(r + 1), torch::TensorOptions(o.device))};
      if (groups[static_cast<size_t>(r)]->comm->AllReduce(t).ok()) sums[static_cast<size_t>(r)] = t[0].cpu();
    });
  }
  for (auto& t : threads) t.join();
  const double want_sum = P * (P + 1) / 2.0;
  for (int r = 0; r < P; ++r) {
    const auto& g = groups[static_cast<size_t>(r)];
    ASSERT_TRUE(g.ok()) << "rank " << r << ": " << g.status();
    EXPECT_EQ(g->choice.backend, want) << "rank " << r << ": " << g->choice.reason;
    EXPECT_EQ(g->choice.reason, want_reason) << "rank " << r;
    EXPECT_EQ(g->comm->rank(), r);
    EXPECT_EQ(g->comm->world_size(), P);
    ASSERT_TRUE(sums[static_cast<size_t>(r)].defined()) << "rank " << r << ": the all-reduce failed";
    EXPECT_TRUE(torch::equal(sums[static_cast<size_t>(r)], torch::full({3}, want_sum))) << "rank " << r;
  }
}

TEST(ConnectRanksTest, RanksOnTheCpuKeepTheTcpGroup) {
  ExpectGroupWorks(2, [](int) { return torch::Device(torch::kCPU); }, CollectiveBackend::kTcp,
                   NcclBuilt() ? "rank 0 computes on the CPU" : "this build has no NCCL");
  ExpectGroupWorks(3, [](int) { return torch::Device(torch::kCPU); }, CollectiveBackend::kTcp,
                   NcclBuilt() ? "rank 0 computes on the CPU" : "this build has no NCCL");
}

// W thread-ranks join ConnectRankLayout(P) on the loopback; each sums rank + 1 over its context
// group and 10 (rank + 1) over its data group. Rank r is rank r % P of context group r / P and
// rank r / P of data group r % P.
void ExpectLayoutWorks(int W, int P) {
  const std::string rendezvous = "127.0.0.1:" + std::to_string(*FreePort(/*loopback=*/true));
  std::vector<absl::StatusOr<RankLayout>> layouts;  // move-only: filled one by one
  for (int r = 0; r < W; ++r) layouts.emplace_back(absl::UnknownError("not run"));
  std::vector<double> cp_sums(static_cast<size_t>(W), -1), dp_sums(static_cast<size_t>(W), -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      RankGroupOptions o;
      o.rendezvous = rendezvous;
      o.rank = r;
      o.world_size = W;
      // Short: a broken layout fails in seconds rather than waiting out the defaults.
      o.connect_timeout = absl::Seconds(15);
      o.op_timeout = absl::Seconds(15);
      auto& layout = layouts[static_cast<size_t>(r)];
      layout = ConnectRankLayout(o, P);
      if (!layout.ok()) return;
      if (layout->context.comm) {
        std::vector<torch::Tensor> t = {torch::full({2}, static_cast<double>(r + 1))};
        if (layout->context.comm->AllReduce(t).ok()) cp_sums[static_cast<size_t>(r)] = t[0][0].item<double>();
      }
      if (layout->data.comm) {
        std::vector<torch::Tensor> t = {torch::full({2}, 10.0 * (r + 1))};
        if (layout->data.comm->AllReduce(t).ok()) dp_sums[static_cast<size_t>(r)] = t[0][0].item<double>();
      }
    });
  }
  for (auto& t : threads) t.join();
  const int D = W / P;
  for (int r = 0; r < W; ++r) {
    const std::string at = "W " + std::to_string(W) + " P " + std::to_string(P) + " rank " + std::to_string(r);
    const auto& layout = layouts[static_cast<size_t>(r)];
    ASSERT_TRUE(layout.ok()) << at << ": " << layout.status();
    EXPECT_EQ(layout->context_parallel, P) << at;
    EXPECT_EQ(layout->data_parallel, D) << at;
    double cp_want = 0, dp_want = 0;
    for (int q = r / P * P; q < r / P * P + P; ++q) cp_want += q + 1;
    for (int q = r % P; q < W; q += P) dp_want += 10.0 * (q + 1);
    if (P > 1) {
      ASSERT_TRUE(layout->context.comm) << at;
      EXPECT_EQ(layout->context.comm->rank(), r % P) << at;
      EXPECT_EQ(layout->context.comm->world_size(), P) << at;
      EXPECT_EQ(cp_sums[static_cast<size_t>(r)], cp_want) << at << ": the context group's all-reduce";
    } else {
      EXPECT_FALSE(layout->context.comm) << at;
    }
    if (D > 1) {
      ASSERT_TRUE(layout->data.comm) << at;
      EXPECT_EQ(layout->data.comm->rank(), r / P) << at;
      EXPECT_EQ(layout->data.comm->world_size(), D) << at;
      EXPECT_EQ(dp_sums[static_cast<size_t>(r)], dp_want) << at << ": the data group's all-reduce";
    } else {
      EXPECT_FALSE(layout->data.comm) << at;
    }
  }
}

TEST(ConnectRankLayoutTest, DataParallelOverContextGroups) {
  ASSERT_NO_FATAL_FAILURE(ExpectLayoutWorks(4, 2));  // 2 x 2
  ASSERT_NO_FATAL_FAILURE(ExpectLayoutWorks(6, 3));  // 2 data replicas of 3
  ASSERT_NO_FATAL_FAILURE(ExpectLayoutWorks(6, 2));  // 3 data replicas of 2
  ASSERT_NO_FATAL_FAILURE(ExpectLayoutWorks(2, 2));  // one context group
  ASSERT_NO_FATAL_FAILURE(ExpectLayoutWorks(3, 1));  // data parallel only
}

TEST(ConnectRankLayoutTest, ContextParallelMustDivideTheWorld) {
  RankGroupOptions o;
  o.rendezvous = "127.0.0.1:1";
  o.world_size = 6;
  EXPECT_EQ(ConnectRankLayout(o, 4).status(),
            absl::InvalidArgumentError("context_parallel (4) must be >= 1 and divide world_size (6)"));
  EXPECT_EQ(ConnectRankLayout(o, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// A socket listening on a loopback port the system picked (another process's listener); -1 when
// the system refused. *port is that port.
int ListenSomewhere(int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 4) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    return -1;
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

// The ranks not meeting is marked (the worker then asks the controller for another attempt);
// a wrong option, a cancel and anything else are not.
TEST(RanksDidNotMeetTest, MarksOnlyFailuresToMeet) {
  int taken = 0;
  const int fd = ListenSomewhere(&taken);
  ASSERT_GE(fd, 0) << "no loopback listener: " << std::strerror(errno);
  RankGroupOptions o;
  o.rendezvous = "127.0.0.1:" + std::to_string(taken);
  o.world_size = 2;
  o.connect_timeout = absl::Seconds(5);
  for (int P : {1, 2}) {  // ConnectRanks' path, then the layout's
    absl::Status s = ConnectRankLayout(o, P).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("bind/listen"), absl::string_view::npos) << s;
    EXPECT_TRUE(RanksDidNotMeet(s)) << "P " << P << ": " << s;
  }
  EXPECT_TRUE(RanksDidNotMeet(ConnectRanks(o).status()));
  ::close(fd);

  // Rank 1 waiting for a rank 0 that never listens: it gives up when connect_timeout ends.
  RankGroupOptions late = o;
  late.rendezvous = "127.0.0.1:" + std::to_string(*FreePort(/*loopback=*/true));
  late.rank = 1;
  late.connect_timeout = absl::Milliseconds(300);
  absl::Status waited = ConnectRanks(late).status();
  EXPECT_TRUE(absl::IsDeadlineExceeded(waited) || absl::IsUnavailable(waited)) << waited;
  EXPECT_TRUE(RanksDidNotMeet(waited)) << waited;

  RankGroupOptions cancelled = late;
  cancelled.connect_timeout = absl::Seconds(30);
  cancelled.abort = [] { return true; };
  absl::Status aborted = ConnectRanks(cancelled).status();
  EXPECT_TRUE(absl::IsCancelled(aborted)) << aborted;
  EXPECT_FALSE(RanksDidNotMeet(aborted)) << aborted;

  RankGroupOptions bad = o;
  bad.rendezvous = "no port here";
  absl::Status invalid = ConnectRanks(bad).status();
  EXPECT_TRUE(absl::IsInvalidArgument(invalid)) << invalid;
  EXPECT_FALSE(RanksDidNotMeet(invalid));
  EXPECT_FALSE(RanksDidNotMeet(ConnectRankLayout(o, 3).status()));  // 3 does not divide 2
  EXPECT_FALSE(RanksDidNotMeet(absl::UnavailableError("the peer closed the connection")));  // not from a join
  EXPECT_FALSE(RanksDidNotMeet(absl::OkStatus()));
}

// On a GPU host: two ranks on one GPU cannot use NCCL and keep the TCP star (the one-GPU
// context-parallel runs depend on it); where there are two GPUs, one each moves to NCCL.
TEST(ConnectRanksGpuTest, RanksSharingOneGpuKeepTheTcpGroup) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ExpectGroupWorks(2, [](int) { return torch::Device(torch::kCUDA, 0); }, CollectiveBackend::kTcp,
                   NcclBuilt() ? "ranks 0 and 1 share one GPU (NCCL needs a GPU per rank)" : "this build has no NCCL");
}

TEST(ConnectRanksGpuTest, RanksOnTwoGpusMoveToNccl) {
  if (!NcclBuilt() || torch::cuda::device_count() < 2) GTEST_SKIP() << "needs NCCL and two GPUs";
  // Thread-ranks of one process, one GPU each: ChooseBackend sees two UUIDs.
  ExpectGroupWorks(2, [](int r) { return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(r)); },
                   CollectiveBackend::kNccl, "every rank on a GPU of its own");
}

}  // namespace
}  // namespace odyssey::engine
