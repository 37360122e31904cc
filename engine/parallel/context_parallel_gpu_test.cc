// Context parallelism in bf16 on one GPU, with the ranks as processes (issue 14's one-GPU check).
//
// Two ranks of one context-parallel group, each its own process with its own CUDA context,
// streams and buffers, share the one GPU and meet over the TCP star (engine::ConnectRanks keeps
// TCP when ranks share a GPU). Each holds half of every row and runs the real cuDNN attention in
// bf16. Their gradients of one batch are held against a float32 forward/backward of the same
// weights and tokens, next to the single-rank bf16 run's: the parallel run's error must be
// within 2x the single-rank one's (the shards change the order of the bf16 sums, not their
// precision). Thread-ranks cannot do this on one GPU: autograd runs the backward of every
// thread on one engine thread per device, so two ranks' backward collectives wait on each
// other (docs/gpu.md).
//
// The test re-runs its own binary for the ranks (ODYSSEY_CP_GPU_RANK in the environment picks
// the rank's role) and skips without a CUDA device.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>


#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/parallel/rank_group.h"
#include "engine/trainer.h"

extern char** environ;

namespace odyssey::engine {
namespace {

constexpr int kRanks = 2;

// "dense": two layers of the 1B shape (32 query heads, 8 KV heads of 128); "hybrid": the first
// four layers of hybrid-3b (KKKD: its KDA and DSA layers split their heads over the ranks,
// model/hybrid.h; 4096 tokens, so the DSA layer's 2048 keys + tail are truly sparse). 4096
// random tokens.
TrainerOptions Options(const std::string& dtype, const std::string& attention, const std::string& shape) {
  TrainerOptions o;
  o.model = shape == "hybrid" ? "hybrid-3b" : "llama-3.2-1b";
  o.num_layers = shape == "hybrid" ? 4 : 2;
  o.device = "cuda:0";
  o.dtype = dtype;
  o.attention = attention;
  o.steps = 1;
  o.seed = 11;
  o.data.format = "random";
  o.data.seq_len = 4096;
  o.data.batch_size = 1;
  o.data.seed = 3;
  return o;
}

// The gradients in name order, the loss last.
std::vector<torch::Tensor> Flatten(const BatchGradients& g) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, t] : g.grads) out.push_back(t.detach().to(torch::kCPU, torch::kFloat32));
  out.push_back(torch::tensor({g.loss}, torch::kFloat64));
  return out;
}


// A rank's role: join the group, take the gradients of the first batch, save them. Returns the
// exit code (0 = saved).
int RunRank(int rank, const std::string& rendezvous, const std::string& out, const std::string& shape) {
  RankGroupOptions go;
  go.rendezvous = rendezvous;
  go.rank = rank;
  go.world_size = kRanks;
  go.device = torch::Device(torch::kCUDA, 0);
  go.connect_timeout = absl::Seconds(120);
  absl::StatusOr<RankGroup> g = ConnectRanks(go);
  if (!g.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, g.status().ToString().c_str());
    return 2;
  }
  if (g->choice.backend != CollectiveBackend::kTcp) {
    std::fprintf(stderr, "rank %d: expected the TCP star on one GPU, got %s\n", rank, BackendName(g->choice.backend));
    return 3;
  }
  TrainerOptions o = Options("bfloat16", "cudnn", shape);
  o.context_parallel.group = g->comm.get();
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(o);
  if (!t.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, t.status().ToString().c_str());
    return 4;
  }
  const Batch batch = (*t)->data().Next();
  absl::StatusOr<BatchGradients> grads = (*t)->Gradients(batch);
  if (!grads.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, grads.status().ToString().c_str());
    return 5;
  }
  torch::save(Flatten(*grads), out);
  return 0;
}

// ||a - b|| / ||b|| over the tensors of `which` (all but the loss).
double RelativeError(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, size_t begin, size_t end) {
  double num = 0, den = 0;
  for (size_t i = begin; i < end; ++i) {
    num += (a[i] - b[i]).pow(2).sum().item<double>();
    den += b[i].pow(2).sum().item<double>();
  }
  return std::sqrt(num / den);
}

// The check of the file comment for `shape` (Options), the ranks re-running `test` of this binary.
void ExpectProcessRanksMatchOneRank(const std::string& shape, const std::string& test) {
  if (const char* rank = std::getenv("ODYSSEY_CP_GPU_RANK")) {  // a rank's process
    const int code =
        RunRank(std::atoi(rank), std::getenv("ODYSSEY_CP_GPU_RENDEZVOUS"), std::getenv("ODYSSEY_CP_GPU_OUT"), shape);
    std::fflush(stderr);
    std::_Exit(code);
  }
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("odyssey-cp-gpu-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string rendezvous = "127.0.0.1:" + std::to_string(*FreePort(/*loopback=*/true));

  // The ranks first (they take a while to start), then the references in this process.
  std::vector<pid_t> pids;
  for (int r = 0; r < kRanks; ++r) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
    env_strings.push_back("ODYSSEY_CP_GPU_RANK=" + std::to_string(r));
    env_strings.push_back("ODYSSEY_CP_GPU_RENDEZVOUS=" + rendezvous);
    env_strings.push_back("ODYSSEY_CP_GPU_OUT=" + (dir / ("rank" + std::to_string(r) + ".pt")).string());
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
    std::string filter = "--gtest_filter=ContextParallelGpuTest." + test;
    std::vector<char*> argv = {exe.data(), filter.data(), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data()), 0);
    pids.push_back(pid);
  }

  TrainerOptions one = Options("bfloat16", "cudnn", shape);
  auto single = Trainer::Create(one);
  ASSERT_TRUE(single.ok()) << single.status();
  const Batch batch = (*single)->data().Next();
  absl::StatusOr<BatchGradients> bf16 = (*single)->Gradients(batch);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  // float32 on the same (bf16) weights and tokens.
  TrainerOptions ref = Options("float32", "math", shape);
  auto fp32 = Trainer::Create(ref);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  {
    torch::NoGradGuard no_grad;
    auto src = (*single)->model()->named_parameters();
    for (auto& p : (*fp32)->model()->named_parameters()) p.value().copy_(src[p.key()]);
  }
  absl::StatusOr<BatchGradients> want = (*fp32)->Gradients(batch);
  ASSERT_TRUE(want.ok()) << want.status();

  for (int r = 0; r < kRanks; ++r) {
    int status = 0;
    ASSERT_EQ(waitpid(pids[static_cast<size_t>(r)], &status, 0), pids[static_cast<size_t>(r)]);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r << " exited with " << status;
  }
  std::vector<std::vector<torch::Tensor>> ranks(kRanks);
  for (int r = 0; r < kRanks; ++r) torch::load(ranks[static_cast<size_t>(r)], (dir / ("rank" + std::to_string(r) + ".pt")).string());
  std::filesystem::remove_all(dir);

  const std::vector<torch::Tensor> w = Flatten(*want), s = Flatten(*bf16);
  ASSERT_EQ(ranks[0].size(), w.size());
  ASSERT_EQ(ranks[1].size(), w.size());
  const size_t n = w.size() - 1;  // gradients; the loss is last
  // The ranks hold the same summed gradients.
  for (size_t i = 0; i < n; ++i) EXPECT_TRUE(torch::equal(ranks[0][i], ranks[1][i])) << "gradient " << i;

  const double single_error = RelativeError(s, w, 0, n);
  const double parallel_error = RelativeError(ranks[0], w, 0, n);
  std::printf("%s: bf16 gradients against float32 (relative L2 over all): one rank %.3e, %d process ranks %.3e\n", shape.c_str(),
              single_error, kRanks, parallel_error);
  EXPECT_GT(single_error, 0) << "the bf16 run equals float32: the check would not see an error";
  EXPECT_LE(parallel_error, 2 * single_error);
  for (size_t i = 0; i < n; ++i) {  // and per tensor, with a floor for tensors bf16 gets nearly exact
    const double e1 = RelativeError(s, w, i, i + 1), ep = RelativeError(ranks[0], w, i, i + 1);
    EXPECT_LE(ep, 2 * e1 + 1e-3) << "gradient " << i << ": one rank " << e1 << ", parallel " << ep;
  }
  const double loss32 = w[n].item<double>();
  const double loss_single = s[n].item<double>(), loss_parallel = ranks[0][n].item<double>();
  std::printf("loss: float32 %.6f, one rank %.6f, parallel %.6f\n", loss32, loss_single, loss_parallel);
  EXPECT_LE(std::abs(loss_parallel - loss32), 2 * std::abs(loss_single - loss32) + 1e-3 * loss32);
}

TEST(ContextParallelGpuTest, ProcessRanksOnOneGpuMatchOneRankInBf16) {
  ExpectProcessRanksMatchOneRank("dense", "ProcessRanksOnOneGpuMatchOneRankInBf16");
}

// The hybrid family's layers on the GPU path (the CUDA KDA, indexer and sparse attention kernels
// on a rank's heads of the whole sequence, the collectives on CUDA tensors).
TEST(ContextParallelGpuTest, HybridProcessRanksOnOneGpuMatchOneRankInBf16) {
  ExpectProcessRanksMatchOneRank("hybrid", "HybridProcessRanksOnOneGpuMatchOneRankInBf16");
}

}  // namespace
}  // namespace odyssey::engine
