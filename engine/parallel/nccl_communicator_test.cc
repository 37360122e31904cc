// The NCCL communicator on the GPUs of one host (GPU only: skips without CUDA or without a build
// with NCCL). One thread per rank, each with its own GPU and process group, world size = the
// GPUs visible, at most 2 (one GPU: world size 1, where every call but all-to-all still runs
// NCCL). Each collective is checked against the same math done directly.
#ifdef ODYSSEY_WITH_NCCL
#include "engine/parallel/nccl_communicator.h"
#endif

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/parallel/communicator.h"

namespace odyssey::engine {
namespace {

#ifdef ODYSSEY_WITH_NCCL
// A loopback port free at the time of the call (the store binds it right after).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Per rank r: a tensor of awkward size, seeded by rank.
torch::Tensor RankTensor(int r, int64_t n, torch::Dtype dtype) {
  at::Generator gen = at::detail::createCPUGenerator(77 + r);
  return torch::randn({n}, gen).to(dtype);
}
#endif

TEST(NcclCommunicatorTest, CollectivesMatchTheMath) {
#ifndef ODYSSEY_WITH_NCCL
  GTEST_SKIP() << "built without NCCL (the CPU build): run on a GPU host";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int P = std::min<int>(2, static_cast<int>(torch::cuda::device_count()));
  const std::string rendezvous = "127.0.0.1:" + std::to_string(FreePort());
  std::vector<std::thread> threads;
  std::vector<std::string> failures(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      auto fail = [&](const std::string& what) { failures[static_cast<size_t>(r)] += what + "\n"; };
      NcclCommunicatorOptions o;
      o.rendezvous = rendezvous;
      o.rank = r;
      o.world_size = P;
      o.device_index = r;
      o.connect_timeout = absl::Seconds(60);
      o.op_timeout = absl::Seconds(120);
      auto comm = NcclCommunicator::Create(o);
      if (!comm.ok()) return fail(comm.status().ToString());
      const torch::Device gpu(torch::kCUDA, static_cast<c10::DeviceIndex>(r));
      // All-reduce: fp32 and bf16 (reduced in fp32), a CPU tensor among GPU ones.
      std::vector<torch::Tensor> t = {RankTensor(r, 97, torch::kFloat32).to(gpu), RankTensor(r, 257, torch::kBFloat16).to(gpu),
                                      RankTensor(r, 5, torch::kFloat32)};
      if (auto s = (*comm)->AllReduce(t); !s.ok()) return fail(s.ToString());
      torch::Tensor want32 = torch::zeros({97}), want16 = torch::zeros({257}), want_cpu = torch::zeros({5});
      for (int q = 0; q < P; ++q) {
        want32 += RankTensor(q, 97, torch::kFloat32);
        want16 += RankTensor(q, 257, torch::kBFloat16).to(torch::kFloat32);
        want_cpu += RankTensor(q, 5, torch::kFloat32);
      }
      if (!torch::allclose(t[0].cpu(), want32, 1e-6, 1e-6)) fail("all-reduce fp32");
      if (!torch::equal(t[1].cpu(), want16.to(torch::kBFloat16))) fail("all-reduce bf16 (fp32 accumulation)");
      if (t[2].device().is_cuda() || !torch::allclose(t[2], want_cpu, 1e-6, 1e-6)) fail("all-reduce of a CPU tensor");
      // Broadcast from the last rank.
      std::vector<torch::Tensor> b = {RankTensor(r, 33, torch::kFloat32).to(gpu)};
      if (auto s = (*comm)->Broadcast(b, P - 1); !s.ok()) return fail(s.ToString());
      if (!torch::equal(b[0].cpu(), RankTensor(P - 1, 33, torch::kFloat32))) fail("broadcast");
      // All-gather, synchronous and started early.
      auto g = (*comm)->AllGather(RankTensor(r, 11, torch::kBFloat16).to(gpu));
      if (!g.ok()) return fail(g.status().ToString());
      std::unique_ptr<PendingCollective> pending = (*comm)->StartAllGather(RankTensor(r, 6, torch::kFloat32).view({2, 3}).to(gpu));
      std::vector<torch::Tensor> parts11, parts6;
      for (int q = 0; q < P; ++q) {
        parts11.push_back(RankTensor(q, 11, torch::kBFloat16));
        parts6.push_back(RankTensor(q, 6, torch::kFloat32));
      }
      if (!torch::equal(g->cpu(), torch::cat(parts11))) fail("all-gather");
      auto later = pending->Wait();
      if (!later.ok()) return fail(later.status().ToString());
      if (!torch::equal(later->cpu(), torch::cat(parts6))) fail("started all-gather");
      // Reduce-scatter: this rank's slice of the sum.
      auto rs = (*comm)->ReduceScatter(RankTensor(r, 8 * P, torch::kFloat32).to(gpu));
      if (!rs.ok()) return fail(rs.status().ToString());
      torch::Tensor sum = torch::zeros({8 * P});
      for (int q = 0; q < P; ++q) sum += RankTensor(q, 8 * P, torch::kFloat32);
      if (!torch::allclose(rs->cpu(), sum.slice(0, 8 * r, 8 * (r + 1)), 1e-6, 1e-6)) fail("reduce-scatter");
      // All-to-all (Ulysses' layout change): (P * 3, 4) split 0, concat 1.
      torch::Tensor x = RankTensor(r, 12 * P, torch::kFloat32).view({3 * P, 4});
      auto a = (*comm)->AllToAll(x.to(gpu), 0, 1);
      if (!a.ok()) return fail(a.status().ToString());
      std::vector<torch::Tensor> got;
      for (int q = 0; q < P; ++q) got.push_back(RankTensor(q, 12 * P, torch::kFloat32).view({3 * P, 4}).slice(0, 3 * r, 3 * (r + 1)));
      if (!torch::equal(a->cpu(), torch::cat(got, 1))) fail("all-to-all");
      if (auto s = (*comm)->Barrier(); !s.ok()) fail(s.ToString());
      auto bad = (*comm)->ReduceScatter(torch::ones({2 * P + 1}, torch::TensorOptions().device(gpu)));
      if (P > 1 && bad.status().code() != absl::StatusCode::kInvalidArgument) fail("reduce-scatter of a bad size");
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < P; ++r) EXPECT_EQ(failures[static_cast<size_t>(r)], "") << "rank " << r;
#endif
}

TEST(NcclCommunicatorTest, BadOptionsNameTheField) {
#ifndef ODYSSEY_WITH_NCCL
  GTEST_SKIP() << "built without NCCL (the CPU build): run on a GPU host";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  NcclCommunicatorOptions o;
  o.rendezvous = "127.0.0.1:1";
  o.rank = 2;
  o.world_size = 2;
  auto c = NcclCommunicator::Create(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("rank (2)"), std::string::npos) << c.status();
  o.rank = 0;
  o.device_index = 1000;
  c = NcclCommunicator::Create(o);
  EXPECT_NE(c.status().message().find("device_index (1000)"), std::string::npos) << c.status();
  o.device_index = 0;
  o.rendezvous = "no-port";
  c = NcclCommunicator::Create(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
#endif
}

}  // namespace
}  // namespace odyssey::engine
