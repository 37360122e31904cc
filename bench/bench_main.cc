// odyssey-bench: times full training steps (forward + backward + AdamW) of a named shape at
// one sequence length with a chosen memory strategy, and prints a JSON line and a table:
// peak GPU bytes (allocated, reserved), peak pinned host bytes, seconds per step, tokens/s,
// MFU, and the planner's prediction for the same run.
//
// FLOPs per step (model FLOPs; recompute is not counted):
//   6 * N * T              the weights, N = parameters used in matmuls (all but the input
//                          embedding when untied), T = B * S tokens
//   + 6 * B * S^2 * Hq * D * L
//                          causal attention: forward 4*S^2*Hq*D per layer (QK^T and PV),
//                          backward twice that (12 in all), halved for causality
// MFU = FLOPs / step time / 989e12 (H100/H200 dense bf16 peak).
//
// --rl-loss KIND times an RL session's calls instead: each step is ForwardBackward(batch-size
// datums of seq-len tokens, KIND) + OptimStep, as the worker runs them for TrainingService. The
// datums' sampler logprobs are the model's own (one Forward before the timed steps, so PPO's
// ratios start near 1, as with a well-matched inference engine) and the advantages are +-1. The
// Forward's time is reported too (forward_seconds). Same FLOP accounting.
//
// --context-parallel P spreads the sequence over P ranks, each its own process (this binary
// re-run with ODYSSEY_BENCH_RANK set), on GPU r % (GPUs) (NCCL between GPUs; ranks sharing a
// GPU, or on the CPU, meet over TCP), with --shard the parameters, gradients and AdamW state
// sharded over them (ZeRO-3). The parent waits for the ranks and prints one line for the group:
// the slowest rank's step time, the sequence's tokens/s, MFU over P GPUs' peak, and the largest
// per-rank GPU and pinned peaks; each rank's own figures are under "ranks".
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "CLI/CLI.hpp"
#include "common/version.h"
#include "absl/strings/str_format.h"
#include "engine/device_stats.h"
#include "engine/memory/checkpoint.h"
#include "engine/parallel/rank_group.h"
#include "engine/profiler.h"
#include "engine/rl_loss.h"
#include "engine/trainer.h"
#include "kernels/attention.h"
#include "kernels/fused_ops.h"
#include "model/hybrid.h"
#include "model/weights.h"
#include "nlohmann/json.hpp"
#include "planner/planner.h"

namespace {

constexpr double kPeakFlops = 989e12;

// Appends j as one line to `path` (--json); nothing when the path is empty.
void AppendJsonLine(const std::string& path, const nlohmann::json& j) {
  if (path.empty()) return;
  FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr) return;
  std::fprintf(f, "%s\n", j.dump().c_str());
  std::fclose(f);
}

// The fidelity reference's attention: float32 causal attention computed in blocks of queries
// (each block against the keys it can see, the diagonal block masked), GQA by batching each KV
// head's G query heads into one product (no expanded K/V), no autograd. Plain fp32 matmuls (cuBLAS
// SGEMM; TF32 stays off, libtorch's default), so its error is float32's, and no block holds more
// than ~2 GiB of scores: ATen's float32 SDPA ran 64K for minutes and the math backend's full
// (S, S) scores do not fit at 128K.
class BlockedFloat32Attention : public odyssey::kernels::AttentionBackend {
 public:
  explicit BlockedFloat32Attention(int64_t block) : block_(block) {}
  std::string name() const override { return "fp32-blocked-reference"; }
  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    torch::NoGradGuard no_grad;
    const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1), G = Hq / Hkv;
    const torch::Tensor q5 = q.to(torch::kFloat32).view({B, Hkv, G, S, D});
    // K and V as (B * Hkv, S, D): each KV head's keys meet its G query heads' rows in one batched
    // product (a broadcast matmul would copy K and V G times per block).
    const torch::Tensor k3 = k.to(torch::kFloat32).reshape({B * Hkv, S, D}).contiguous();
    const torch::Tensor v3 = v.to(torch::kFloat32).reshape({B * Hkv, S, D}).contiguous();
    torch::Tensor out = torch::empty({B, Hkv, G, S, D}, q5.options());
    const int64_t budget = int64_t{1} << 31;  // bytes of fp32 scores per block
    const int64_t block =
        block_ > 0 ? block_ : std::clamp<int64_t>(budget / std::max<int64_t>(1, B * Hq * S * 4), 16, 4096);
    for (int64_t q0 = 0; q0 < S; q0 += block) {
      const int64_t n = std::min(block, S - q0), keys = q0 + n;
      const torch::Tensor qb = q5.narrow(3, q0, n).reshape({B * Hkv, G * n, D});
      torch::Tensor scores = torch::bmm(qb, k3.narrow(1, 0, keys).transpose(1, 2))
                                 .mul_(scale)
                                 .view({B, Hkv, G, n, keys});
      // Query q0 + i sees keys 0..q0 + i: mask the diagonal block's upper triangle.
      torch::Tensor mask = torch::ones({n, n}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
      scores.narrow(4, q0, n).masked_fill_(mask, -std::numeric_limits<float>::infinity());
      const torch::Tensor p = torch::softmax(scores, -1).view({B * Hkv, G * n, keys});
      out.narrow(3, q0, n).copy_(torch::bmm(p, v3.narrow(1, 0, keys)).view({B, Hkv, G, n, D}));
    }
    return out.view({B, Hq, S, D}).to(q.scalar_type());
  }

 private:
  const int64_t block_;  // queries per block; 0 = as many as ~2 GiB of scores allow
};

// 6 N T for the matmuls plus attention: dense causal 6 S^2 H D per layer; for the hybrid family
// the DSA layers' attention over the selected keys (query t sees min(t + 1, index_top_k + 3);
// forward 4 H D per key, backward twice that) and the indexer's causal scoring (forward only:
// 2 HI DI per visible (query, pool) pair, ~S^2 / 8 pairs). KDA's chunk work is not counted.
double ModelFlops(const odyssey::model::ModelConfig& c, int64_t B, int64_t S) {
  const double matmul_params = static_cast<double>(c.NumParameters()) -
                               (c.tie_word_embeddings ? 0.0 : static_cast<double>(c.vocab_size * c.hidden_size));
  const double tokens = static_cast<double>(B * S), s = static_cast<double>(S);
  const double hd = static_cast<double>(c.num_attention_heads * c.HeadDim());
  if (c.IsHybrid()) {
    const double w = static_cast<double>(c.hybrid.index_top_k + 3);
    const double keys = s <= w ? s * (s + 1) / 2 : w * (w + 1) / 2 + (s - w) * w;  // sum over queries
    const double per_layer = 12.0 * keys * hd + s * s / 8.0 * 2.0 * static_cast<double>(c.hybrid.index_num_heads *
                                                                                          c.hybrid.index_head_dim);
    return 6.0 * matmul_params * tokens +
           static_cast<double>(B) * per_layer * static_cast<double>(c.NumLayersOfKind('D'));
  }
  const double attention = 6.0 * static_cast<double>(B) * s * s * hd * static_cast<double>(c.num_hidden_layers);
  return 6.0 * matmul_params * tokens + attention;
}

std::string GiB(int64_t b) { return absl::StrFormat("%.2f", static_cast<double>(b) / (1 << 30)); }

extern "C" char** environ;

// --context-parallel's parent: runs this binary's command line as P rank processes, waits for
// them, and returns the ranks' result objects (rank order); an error names the first rank that
// failed. The ranks meet at a loopback port chosen here.
absl::StatusOr<std::vector<nlohmann::json>> RunRanks(int argc, char** argv, int P) {
  absl::StatusOr<int> port = odyssey::engine::FreePort(/*loopback=*/true);
  if (!port.ok()) return port.status();
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("odyssey-bench-ranks-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<pid_t> pids;
  for (int r = 0; r < P; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.push_back("ODYSSEY_BENCH_RANK=" + std::to_string(r));
    env.push_back("ODYSSEY_BENCH_RENDEZVOUS=127.0.0.1:" + std::to_string(*port));
    env.push_back("ODYSSEY_BENCH_RESULT=" + (dir / ("rank-" + std::to_string(r) + ".json")).string());
    std::vector<char*> envp, args;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> arg_strings(argv, argv + argc);
    for (auto& s : arg_strings) args.push_back(s.data());
    args.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, exe.c_str(), nullptr, nullptr, args.data(), envp.data()) != 0)
      return absl::InternalError(absl::StrCat("could not start rank ", r, " (", exe, ")"));
    pids.push_back(pid);
  }
  std::string failed;
  for (int r = 0; r < P; ++r) {
    int status = 0;
    waitpid(pids[static_cast<size_t>(r)], &status, 0);
    if (failed.empty() && !(WIFEXITED(status) && WEXITSTATUS(status) == 0))
      failed = absl::StrCat("rank ", r, WIFEXITED(status) ? " exited with " : " was killed by signal ",
                            WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
  }
  std::vector<nlohmann::json> out;
  for (int r = 0; r < P && failed.empty(); ++r) {
    std::ifstream in(dir / ("rank-" + std::to_string(r) + ".json"));
    nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) failed = absl::StrCat("rank ", r, " left no result");
    out.push_back(std::move(j));
  }
  std::filesystem::remove_all(dir);
  if (!failed.empty()) return absl::UnavailableError(failed + " (its output is above)");
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  odyssey::engine::TrainerOptions o;
  o.model = "llama-3.2-3b";
  o.device = "auto";
  o.attention = "auto";
  o.steps = 1 << 30;
  o.optimizer.lr = 1e-5;
  o.data.format = "random";
  o.data.batch_size = 1;
  o.data.seq_len = 65536;
  int steps = 3, warmup = 1;
  std::string& tokens = o.data.format;
  std::string json_path;
  bool plan = true;

  CLI::App app{"odyssey-bench: time full training steps"};
  app.set_version_flag("--version", odyssey::VersionLine("odyssey-bench"));
  app.add_option("--model", o.model, "named shape")->capture_default_str();
  app.add_option("--layers", o.num_layers, "cut the shape to this many layers (0 = all)")->capture_default_str();
  app.add_option("--seq-len", o.data.seq_len, "tokens per sequence")->capture_default_str();
  app.add_option("--batch-size", o.data.batch_size, "sequences per step")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_option("--device", o.device, "auto | cpu | cuda:N")->capture_default_str();
  app.add_option("--dtype", o.dtype, "auto | bfloat16 | float32")->capture_default_str();
  app.add_option("--attention", o.attention, "auto | cudnn | sdpa | math")->capture_default_str();
  app.add_option("--indexer-stage", o.indexer_stage,
                 "hybrid models with DSA layers: dense_warmup | sparse replaces the config's indexer stage (empty = the model's)");
  app.add_option("--kda-chunk-size", o.kda_chunk_size,
                 "hybrid models with KDA layers: 32 | 64 replaces the config's chunk size (0 = the model's)")
      ->capture_default_str();
  app.add_option("--head-groups", o.memory.head_groups, "KV-head groups run one after another")->capture_default_str();
  std::string recompute = "none";
  app.add_option("--recompute", recompute, "none | layer | every_k")->capture_default_str();
  app.add_option("--every-k", o.memory.every_k, "layers per checkpoint group (every_k)")->capture_default_str();
  app.add_flag("--offload", o.memory.offload, "offload checkpointed inputs to pinned host memory");
  app.add_option("--device-resident", o.memory.device_resident, "with --offload: checkpoints kept on the GPU")
      ->capture_default_str();
  app.add_option("--mlp-tile", o.memory.mlp_tile, "positions per MLP tile (0: untiled)")->capture_default_str();
  app.add_option("--loss-tile", o.memory.loss_tile, "positions per loss tile (0: untiled)")->capture_default_str();
  app.add_flag("--keep-attention", o.memory.keep_attention,
               "keep each layer's attention output + LSE; the recompute skips the attention forward");
  app.add_flag("--keep-selection", o.memory.keep_selection,
               "DSA layers keep the first forward's pool selections in pinned host memory; the recompute runs no "
               "indexer scoring");
  app.add_flag("--bf16-moments", o.memory.bf16_moments,
               "with --optimizer-on-host: AdamW's moments in bf16 on the host (fp32 masters kept)");
  app.add_flag("--optimizer-on-host", o.memory.optimizer_on_host,
               "fp32 master weights and moments in host memory, AdamW on CPU threads overlapped with the step");
  app.add_option("--host-budget-bytes", o.memory.host_budget_bytes, "pinned host budget in bytes (0: none)");
  app.add_option("--lora-rank", o.lora.rank, "LoRA adapters of this rank on every projection, the base frozen (0: off)")
      ->capture_default_str();
  app.add_option("--tokens", tokens, "random | kjv (King James bytes)")->capture_default_str();
  app.add_option("--json", json_path, "append the JSON result to this file");
  app.add_flag("!--no-plan", plan, "skip the planner's prediction");
  bool fidelity = false;
  app.add_flag("--fidelity", fidelity,
               "instead of timing: per-token logprobs of the batch from the training forward (bf16, under the "
               "memory strategy) against a float32 forward of the same weights and tokens; prints mean and max |d|");
  double fidelity_max_diff = -1;
  app.add_option("--fidelity-max-diff", fidelity_max_diff,
                 "with --fidelity: exit 1 when the max |d| exceeds this (a check; negative: none)");
  int64_t fidelity_block = 0;
  app.add_option("--fidelity-block", fidelity_block,
                 "with --fidelity: queries per block of the float32 reference attention (0: ~2 GiB of scores)");
  bool phase_times = false;
  app.add_flag("--phase-times", phase_times,
               "time the phases of the timed steps (each layer's forward, recompute and backward, the loss, the "
               "optimizer and the kernels' own phases; GPU time by CUDA events, no trace) and print them per step");
  std::string profile_dir;
  app.add_option("--profile", profile_dir,
                 "after the timed steps, record one more step with the profiler and write DIR/trace.json (Chrome "
                 "trace; bench/profile_report.py summarizes it)");
  bool reference_kernels = false;
  app.add_flag("--reference-kernels", reference_kernels,
               "run libtorch's reference ops instead of odyssey's CUDA kernels (RMSNorm, SwiGLU, RoPE, AdamW, "
               "residual GEMM)");
  bool cudnn_expand_kv = false;
  app.add_flag("--cudnn-expand-kv", cudnn_expand_kv,
               "the kept-attention cuDNN kernels get K/V expanded to one head per query head (the older path) "
               "instead of their own KV heads");
  std::string rl_loss;
  int64_t kda_tile = 0, kda_segment = 0;
  CLI::Option* kda_tile_opt = app.add_option("--kda-tile", kda_tile,
                                             "hybrid models: tokens per KDA sequence tile (0: untiled; default "
                                             "KdaAttentionImpl::kDefaultTile)");
  CLI::Option* kda_segment_opt =
      app.add_option("--kda-segment", kda_segment,
                     "hybrid models: tokens per segment of the chunked KDA op, a positive multiple of the chunk "
                     "size (default KdaAttentionImpl::kDefaultSegment)");
  int64_t dsa_tile = 0;
  CLI::Option* dsa_tile_opt = app.add_option("--dsa-tile", dsa_tile,
                                             "hybrid models: queries per tile of the DSA layer's sparse stage, >= 1 "
                                             "(default DsaAttentionImpl::kDefaultTile)");
  app.add_option("--rl-loss", rl_loss,
                 "time RL calls instead of SFT steps: ForwardBackward with this loss (cross_entropy | "
                 "importance_sampling | ppo) on batch-size datums of seq-len tokens, then OptimStep");
  int context_parallel = 1;
  app.add_option("--context-parallel", context_parallel,
                 "ranks the sequence is spread over, one process each (GPU r % GPUs; 1: this process)")
      ->capture_default_str();
  bool shard = false;
  app.add_flag("--shard", shard, "with --context-parallel: shard parameters, gradients and AdamW state over the ranks");
  CLI11_PARSE(app, argc, argv);
  if (context_parallel < 1) {
    std::fprintf(stderr, "odyssey-bench: --context-parallel (%d) must be >= 1\n", context_parallel);
    return 2;
  }
  if (shard && context_parallel == 1) {
    std::fprintf(stderr, "odyssey-bench: --shard needs --context-parallel > 1 (it shards over those ranks)\n");
    return 2;
  }
  if (context_parallel > 1 && (fidelity || !profile_dir.empty())) {
    std::fprintf(stderr, "odyssey-bench: --context-parallel with %s is not implemented\n",
                 fidelity ? "--fidelity" : "--profile");
    return 2;
  }
  const char* rank_env = std::getenv("ODYSSEY_BENCH_RANK");
  const std::string result_path = rank_env != nullptr ? std::getenv("ODYSSEY_BENCH_RESULT") : "";
  if (context_parallel > 1 && rank_env == nullptr) {
    // The parent: the ranks run the steps; one line for the group from their results.
    absl::StatusOr<std::vector<nlohmann::json>> ranks = RunRanks(argc, argv, context_parallel);
    if (!ranks.ok()) {
      std::fprintf(stderr, "odyssey-bench: %s\n", std::string(ranks.status().message()).c_str());
      return 1;
    }
    nlohmann::json j = (*ranks)[0];
    double sec = 0;
    int64_t peak_alloc = 0, peak_reserved = 0, pinned = 0;
    for (const nlohmann::json& r : *ranks) {
      sec = std::max(sec, r.value("seconds_per_step", 0.0));
      peak_alloc = std::max<int64_t>(peak_alloc, r.value("gpu_peak_allocated_bytes", int64_t{0}));
      peak_reserved = std::max<int64_t>(peak_reserved, r.value("gpu_peak_reserved_bytes", int64_t{0}));
      pinned = std::max<int64_t>(pinned, r.value("pinned_host_bytes", int64_t{0}));
    }
    const double tokens = static_cast<double>(o.data.batch_size * o.data.seq_len);
    const double flops = j.value("model_flops_per_step", 0.0);
    j["ranks"] = *ranks;
    j["rank"] = nullptr;
    j["seconds_per_step"] = sec;
    j["tokens_per_second"] = sec > 0 ? tokens / sec : 0.0;
    j["mfu"] = sec > 0 ? flops / sec / (kPeakFlops * context_parallel) : 0.0;
    j["gpu_peak_allocated_bytes"] = peak_alloc;
    j["gpu_peak_reserved_bytes"] = peak_reserved;
    j["pinned_host_bytes"] = pinned;
    std::printf("%s\n", j.dump().c_str());
    std::printf("| model | layers | seq | ranks | memory | largest rank's GPU peak alloc / reserved GiB | pinned GiB | "
                "s/step | tok/s | MFU |\n");
    std::printf("| %s | %lld | %lld | %d%s | %s | %s / %s | %s | %.2f | %.0f | %.1f%% |\n", o.model.c_str(),
                static_cast<long long>(j.value("layers", int64_t{0})), static_cast<long long>(o.data.seq_len),
                context_parallel, shard ? " sharded" : "", j.value("memory", std::string()).c_str(),
                GiB(peak_alloc).c_str(), GiB(peak_reserved).c_str(), GiB(pinned).c_str(), sec,
                sec > 0 ? tokens / sec : 0.0, sec > 0 ? 100.0 * flops / sec / (kPeakFlops * context_parallel) : 0.0);
    AppendJsonLine(json_path, j);
    return 0;
  }
  // A rank of --context-parallel: its GPU, then the group.
  std::unique_ptr<odyssey::engine::Communicator> group;
  if (rank_env != nullptr) {
    const int rank = std::atoi(rank_env);
    torch::Device device(torch::kCPU);
    const bool cuda = o.device == "auto" ? torch::cuda::is_available() : o.device.rfind("cuda", 0) == 0;
    if (cuda) {
      device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank % std::max<int64_t>(1, torch::cuda::device_count())));
      o.device = device.str();
    }
    odyssey::engine::RankGroupOptions go;
    go.rendezvous = std::getenv("ODYSSEY_BENCH_RENDEZVOUS");
    go.rank = rank;
    go.world_size = context_parallel;
    go.device = device;
    absl::StatusOr<odyssey::engine::RankGroup> joined = odyssey::engine::ConnectRanks(go);
    if (!joined.ok()) {
      std::fprintf(stderr, "odyssey-bench: rank %d: %s\n", rank, joined.status().ToString().c_str());
      return 1;
    }
    std::fprintf(stderr, "rank %d/%d on %s, collectives over %s\n", rank, context_parallel, device.str().c_str(),
                 odyssey::engine::BackendName(joined->choice.backend));
    group = std::move(joined->comm);
    o.context_parallel.group = group.get();
    o.shard_params = shard;
  }
  odyssey::kernels::SetFusedKernels(!reference_kernels);
  odyssey::kernels::SetCudnnExpandKv(cudnn_expand_kv);
  if (absl::StatusOr<odyssey::planner::Recompute> r = odyssey::planner::ParseRecompute(recompute, "--recompute");
      r.ok()) {
    o.memory.recompute = *r;
  } else {
    std::fprintf(stderr, "odyssey-bench: %s\n", std::string(r.status().message()).c_str());
    return 2;
  }
  odyssey::engine::LossSpec rl_spec;
  if (!rl_loss.empty()) {
    absl::StatusOr<odyssey::engine::LossKind> kind = odyssey::engine::ParseLossKind(rl_loss);
    if (!kind.ok()) {
      std::fprintf(stderr, "odyssey-bench: --rl-loss: %s\n", std::string(kind.status().message()).c_str());
      return 2;
    }
    rl_spec.kind = *kind;
  }

  auto created = odyssey::engine::Trainer::Create(o);
  if (!created.ok()) {
    std::fprintf(stderr, "odyssey-bench: %s\n", std::string(created.status().message()).c_str());
    return 2;
  }
  auto& t = **created;
  const auto& cfg = t.model()->config();
  const bool set_kda_tile = kda_tile_opt->count() > 0, set_kda_segment = kda_segment_opt->count() > 0;
  if (set_kda_tile && kda_tile < 0) {
    std::fprintf(stderr, "odyssey-bench: --kda-tile (%lld) must be >= 0 (0: untiled)\n",
                 static_cast<long long>(kda_tile));
    return 2;
  }
  if (set_kda_tile || set_kda_segment) {
    int64_t mixers = 0;
    for (const auto& m : t.model()->modules()) {
      auto* kda = dynamic_cast<odyssey::model::KdaAttentionImpl*>(m.get());
      if (kda == nullptr) continue;
      ++mixers;
      if (set_kda_tile) kda->set_tile(kda_tile);
      if (set_kda_segment) {
        if (kda_segment <= 0 || kda_segment % cfg.hybrid.kda_chunk_size != 0) {
          std::fprintf(stderr, "odyssey-bench: --kda-segment (%lld) must be a positive multiple of the chunk size (%lld)\n",
                       static_cast<long long>(kda_segment), static_cast<long long>(cfg.hybrid.kda_chunk_size));
          return 2;
        }
        kda->set_segment(kda_segment);
      }
    }
    if (mixers == 0) {
      std::fprintf(stderr, "odyssey-bench: --kda-tile and --kda-segment act on KDA layers; %s has none\n",
                   o.model.c_str());
      return 2;
    }
    std::fprintf(stderr, "KDA: %lld mixers set:%s%s\n", static_cast<long long>(mixers),
                 set_kda_tile ? (" tile " + std::to_string(kda_tile)).c_str() : "",
                 set_kda_segment ? (" segment " + std::to_string(kda_segment)).c_str() : "");
  }
  const bool set_dsa_tile = dsa_tile_opt->count() > 0;
  if (set_dsa_tile) {
    if (dsa_tile < 1) {
      std::fprintf(stderr, "odyssey-bench: --dsa-tile (%lld) must be >= 1\n", static_cast<long long>(dsa_tile));
      return 2;
    }
    int64_t mixers = 0;
    for (const auto& m : t.model()->modules()) {
      auto* dsa = dynamic_cast<odyssey::model::DsaAttentionImpl*>(m.get());
      if (dsa == nullptr) continue;
      ++mixers;
      dsa->set_tile(dsa_tile);
    }
    if (mixers == 0) {
      std::fprintf(stderr, "odyssey-bench: --dsa-tile acts on DSA layers; %s has none\n", o.model.c_str());
      return 2;
    }
    std::fprintf(stderr, "DSA: %lld mixers set: tile %lld\n", static_cast<long long>(mixers),
                 static_cast<long long>(dsa_tile));
  }
  const int64_t B = o.data.batch_size, S = o.data.seq_len;
  torch::Device dev = t.device();

  const odyssey::engine::Batch batch = t.data().Next();  // the same batch every step
  std::string kernel = "n/a";
  if (dev.is_cuda()) {
    auto opts = torch::TensorOptions().dtype(t.dtype()).device(dev);
    const int64_t D = cfg.HeadDim();
    torch::Tensor q = torch::randn({1, S, cfg.num_attention_heads / o.memory.head_groups, D}, opts).transpose(1, 2);
    torch::Tensor k = torch::randn({1, S, cfg.num_key_value_heads / o.memory.head_groups, D}, opts).transpose(1, 2);
    kernel = odyssey::kernels::SdpaKernelFor(q, k, k, o.attention != "sdpa");
    std::fprintf(stderr, "attention kernel: %s\n", kernel.c_str());
  }

  // RL mode: the batch's rows as datums, with the model's own logprobs as the sampler's.
  std::vector<odyssey::engine::Datum> datums;
  double forward_seconds = 0;
  if (!rl_loss.empty()) {
    const torch::Tensor ids = batch.input_ids.to(torch::kCPU).contiguous(), labels = batch.labels.to(torch::kCPU).contiguous();
    torch::Generator gen = at::detail::createCPUGenerator(1);
    for (int64_t b = 0; b < B; ++b) {
      odyssey::engine::Datum d;
      d.tokens.assign(ids[b].data_ptr<int64_t>(), ids[b].data_ptr<int64_t>() + S);
      d.target_tokens.assign(labels[b].data_ptr<int64_t>(), labels[b].data_ptr<int64_t>() + S);
      const torch::Tensor sign = torch::randint(0, 2, {S}, gen, torch::kFloat32) * 2 - 1;
      d.advantages.assign(sign.data_ptr<float>(), sign.data_ptr<float>() + S);
      datums.push_back(std::move(d));
    }
    odyssey::engine::SynchronizeDevice(dev);
    const auto t0 = std::chrono::steady_clock::now();
    auto logprobs = t.Forward(datums);
    odyssey::engine::SynchronizeDevice(dev);
    forward_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!logprobs.ok()) {
      std::fprintf(stderr, "odyssey-bench: forward: %s\n", std::string(logprobs.status().message()).c_str());
      return 1;
    }
    for (int64_t b = 0; b < B; ++b) datums[b].sampler_logprobs = (*logprobs)[b];
    std::fprintf(stderr, "forward (sampler logprobs): %.3f s\n", forward_seconds);
  }
  if (fidelity) {
    // One datum per row with the cross-entropy loss: ForwardBackward's logprobs come from the
    // forward that training runs (grad on, recompute/offload/tiles/kept attention as planned).
    std::vector<odyssey::engine::Datum> rows;
    const torch::Tensor ids = batch.input_ids.to(torch::kCPU).contiguous(), labels = batch.labels.to(torch::kCPU).contiguous();
    for (int64_t b = 0; b < B; ++b) {
      odyssey::engine::Datum d;
      d.tokens.assign(ids[b].data_ptr<int64_t>(), ids[b].data_ptr<int64_t>() + S);
      d.target_tokens.assign(labels[b].data_ptr<int64_t>(), labels[b].data_ptr<int64_t>() + S);
      rows.push_back(std::move(d));
    }
    odyssey::engine::LossSpec ce;
    ce.kind = odyssey::engine::LossKind::kCrossEntropy;
    const auto fid_t0 = std::chrono::steady_clock::now();
    auto fb = t.ForwardBackward(rows, ce);
    if (!fb.ok()) {
      std::fprintf(stderr, "odyssey-bench: fidelity forward: %s\n", std::string(fb.status().message()).c_str());
      return 1;
    }
    const double bf16_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - fid_t0).count();
    std::fprintf(stderr, "fidelity: the bf16 ForwardBackward took %.1f s\n", bf16_seconds);
    // The same weights in float32 (the bf16 values, upcast), plain forward without autograd.
    auto m32 = odyssey::model::LoadModel(o.model, odyssey::model::ModelOverrides{o.num_layers, o.indexer_stage, o.kda_chunk_size},
                                         torch::kFloat32, dev, o.seed);
    if (!m32.ok()) {
      std::fprintf(stderr, "odyssey-bench: %s\n", std::string(m32.status().message()).c_str());
      return 1;
    }
    torch::NoGradGuard no_grad;
    {
      auto src = t.model()->named_parameters();
      for (auto& p : (*m32)->named_parameters()) p.value().copy_(src[p.key()]);
    }
    (*m32)->set_attention_backend(std::make_shared<const BlockedFloat32Attention>(fidelity_block));
    const auto ref_t0 = std::chrono::steady_clock::now();
    std::fprintf(stderr, "fidelity: the float32 model was ready after %.1f s\n",
                 std::chrono::duration<double>(ref_t0 - fid_t0).count() - bf16_seconds);
    double sum = 0, worst = 0;
    int64_t n = 0;
    try {
      for (int64_t b = 0; b < B; ++b) {
        odyssey::model::ForwardInputs in;
        in.input_ids = batch.input_ids.narrow(0, b, 1).to(dev);
        torch::Tensor hidden = (*m32)->Hidden(in);
        torch::Tensor lp = odyssey::engine::memory::TiledTokenLogprobs(hidden, (*m32)->HeadWeight(),
                                                                      batch.labels.narrow(0, b, 1).to(dev), 2048);
        torch::Tensor ours = torch::tensor(fb->logprobs[b], torch::kFloat32).to(dev);
        torch::Tensor d = (lp.reshape({-1}).to(torch::kFloat32) - ours).abs();  // (S,)
        sum += d.sum().item<double>();
        worst = std::max(worst, d.max().item<double>());
        n += d.numel();
      }
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "odyssey-bench: the float32 reference forward failed: %s\n", e.what_without_backtrace());
      return 1;
    }
    const double ref_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - ref_t0).count();
    std::fprintf(stderr, "fidelity: the float32 reference forward took %.1f s\n", ref_seconds);
    nlohmann::json j = {{"model", o.model}, {"layers", cfg.num_hidden_layers}, {"seq_len", S}, {"batch_size", B},
                        {"memory", o.memory.Describe()}, {"fidelity_mean_abs_logprob_diff", sum / n},
                        {"bf16_seconds", bf16_seconds}, {"reference_seconds", ref_seconds},
                        {"fidelity_max_abs_logprob_diff", worst}, {"tokens", n},
                        {"fused_kernels", odyssey::kernels::FusedKernelsEnabled()}, {"lora_rank", o.lora.rank}};
    std::printf("%s\n| fidelity | %s | %lld | %s | mean |d| %.4f | max |d| %.4f |\n", j.dump().c_str(), o.model.c_str(),
                static_cast<long long>(S), o.memory.Describe().c_str(), sum / n, worst);
    AppendJsonLine(json_path, j);
    if (fidelity_max_diff >= 0 && !(worst <= fidelity_max_diff)) {
      std::fprintf(stderr, "odyssey-bench: fidelity: max |d| %.3g is over --fidelity-max-diff %.3g\n", worst,
                   fidelity_max_diff);
      return 1;
    }
    return 0;
  }
  odyssey::engine::AdamWOptions adam = o.optimizer;
  auto rl_step = [&]() -> absl::StatusOr<double> {
    auto fb = t.ForwardBackward(datums, rl_spec);
    if (!fb.ok()) return fb.status();
    auto os = t.OptimStep(adam);
    if (!os.ok()) return os.status();
    return fb->loss;
  };

  // The planner's figures for the strategy this run uses, before any step: a run the planner
  // would refuse (odyssey-bench runs it anyway, to measure) says so first, so a process killed
  // for host memory leaves a reason in its log.
  odyssey::planner::Prediction planned;
  if (plan) {
    odyssey::planner::Request req;
    req.model = odyssey::planner::ShapeOf(cfg, o.lora);
    req.model.context_ranks = context_parallel;  // a rank's plan: S / P positions
    req.model.shard_ranks = shard ? context_parallel : 1;
    req.model.gradients_to_step = odyssey::planner::GradientsToStep(!rl_loss.empty(), context_parallel);
    req.seq_len = S / context_parallel;
    req.batch_size = B;
    req.strategy = o.memory;  // the strategy the run used, as the planner sees it
    planned = odyssey::planner::Predict(req);
    const odyssey::planner::Hardware hw;
    if (dev.is_cuda() && (planned.gpu_peak_bytes > hw.gpu_bytes || planned.host_bytes > hw.host_bytes)) {
      std::fprintf(stderr,
                   "odyssey-bench: warning: the planner predicts %s GiB GPU and %s GiB host memory for this strategy, "
                   "over its %s GiB GPU / %s GiB host budget; the run may fail or be killed\n",
                   GiB(planned.gpu_peak_bytes).c_str(), GiB(planned.host_bytes).c_str(), GiB(hw.gpu_bytes).c_str(),
                   GiB(hw.host_bytes).c_str());
    }
  }
  std::vector<double> times;
  double loss = 0;
  for (int i = 0; i < warmup + steps; ++i) {
    if (i == warmup) odyssey::engine::ResetPeakMemory(dev);
    if (i == warmup && phase_times) {
      // On a GPU the step's peak is named by the scope that reached it (phase_peak in the JSON).
      std::function<int64_t()> peak;
      if (dev.is_cuda()) peak = [dev] { return odyssey::engine::ReadDeviceMemory(dev).peak_allocated; };
      if (absl::Status st = odyssey::engine::StartPhaseTimes(dev.is_cuda(), std::move(peak)); !st.ok()) {
        std::fprintf(stderr, "odyssey-bench: --phase-times: %s\n", std::string(st.message()).c_str());
        return 1;
      }
    }
    odyssey::engine::SynchronizeDevice(dev);
    const auto t0 = std::chrono::steady_clock::now();
    if (rl_loss.empty()) {
      loss = t.Step(batch).loss;
    } else {
      absl::StatusOr<double> l = rl_step();
      if (!l.ok()) {
        std::fprintf(stderr, "odyssey-bench: RL step %d: %s\n", i, std::string(l.status().message()).c_str());
        return 1;
      }
      loss = *l;
    }
    odyssey::engine::SynchronizeDevice(dev);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "%s step %d: %.3f s, loss %.4f\n", i < warmup ? "warmup" : "timed", i, sec, loss);
    if (i >= warmup) times.push_back(sec);
  }
  std::vector<odyssey::engine::PhaseTime> phases;
  if (phase_times && steps > 0) {
    absl::StatusOr<std::vector<odyssey::engine::PhaseTime>> p = odyssey::engine::StopPhaseTimes();
    if (!p.ok()) {
      std::fprintf(stderr, "odyssey-bench: --phase-times: %s\n", std::string(p.status().message()).c_str());
      return 1;
    }
    phases = *std::move(p);
  }
  const odyssey::engine::PeakScope phase_peak = odyssey::engine::PhasePeak();  // bytes 0: none
  if (!profile_dir.empty() && rl_loss.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(profile_dir, ec);
    const std::string trace = profile_dir + "/trace.json";
    if (absl::Status st = odyssey::engine::StartProfile(dev.is_cuda(), /*memory=*/true); !st.ok()) {
      std::fprintf(stderr, "odyssey-bench: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    odyssey::engine::SynchronizeDevice(dev);
    const auto t0 = std::chrono::steady_clock::now();
    t.Step(batch);
    odyssey::engine::SynchronizeDevice(dev);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (absl::Status st = odyssey::engine::StopProfile(trace); !st.ok()) {
      std::fprintf(stderr, "odyssey-bench: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    std::fprintf(stderr, "profiled step: %.3f s (with the profiler's overhead), trace %s\n", sec, trace.c_str());
  }
  std::sort(times.begin(), times.end());
  const double sec = times.empty() ? 0 : times[times.size() / 2];
  const auto mem = odyssey::engine::ReadDeviceMemory(dev);
  const double flops = ModelFlops(cfg, B, S);
  nlohmann::json j = {
      {"model", o.model}, {"layers", cfg.num_hidden_layers}, {"seq_len", S}, {"batch_size", B},
      {"memory", o.memory.Describe()}, {"attention", t.model()->attention_backend().name()}, {"cudnn_expand_kv", cudnn_expand_kv},
      {"head_groups", o.memory.head_groups}, {"attention_kernel", kernel}, {"seconds_per_step", sec},
      {"tokens_per_second", sec > 0 ? static_cast<double>(B * S) / sec : 0.0},
      {"mfu", sec > 0 ? flops / sec / kPeakFlops : 0.0}, {"model_flops_per_step", flops},
      {"gpu_peak_allocated_bytes", mem.peak_allocated}, {"gpu_peak_reserved_bytes", mem.peak_reserved},
      {"pinned_host_bytes", t.memory().host_pool_bytes()}, {"loss", loss}, {"device", dev.str()},
      {"fused_kernels", odyssey::kernels::FusedKernelsEnabled()}, {"lora_rank", o.lora.rank}};
  if (!phases.empty()) {
    // Per timed step: seconds and scopes of each kind (inclusive of the scopes inside it).
    nlohmann::json pj = nlohmann::json::object();
    for (const auto& p : phases) pj[p.kind] = {{"seconds", p.seconds / steps}, {"count", p.count / steps}};
    j["phase_seconds_per_step"] = pj;
    if (phase_peak.bytes > 0) j["phase_peak"] = {{"bytes", phase_peak.bytes}, {"scopes", phase_peak.path}};
  }
  if (!rl_loss.empty()) {
    j["rl_loss"] = rl_loss;
    j["forward_seconds"] = forward_seconds;
  }
  if (cfg.architecture == odyssey::model::Architecture::kHybrid) {
    for (const auto& m : t.model()->modules()) {
      if (auto* kda = dynamic_cast<odyssey::model::KdaAttentionImpl*>(m.get())) {
        j["kda_tile"] = kda->tile();
        j["kda_segment"] = kda->segment();
        j["kda_chunk_size"] = kda->chunk_size();
        break;
      }
    }
    for (const auto& m : t.model()->modules()) {
      if (auto* dsa = dynamic_cast<odyssey::model::DsaAttentionImpl*>(m.get())) {
        j["dsa_tile"] = dsa->tile();
        break;
      }
    }
  }
  if (plan && (set_kda_tile || set_kda_segment)) {
    // The planner plans the default KDA tile and segment only.
    j["planned_for_default_kda_tile_and_segment"] = true;
  }
  if (plan && set_dsa_tile) j["planned_for_default_dsa_tile"] = true;  // likewise the DSA tile
  if (plan) {
    j["planned_gpu_peak_bytes"] = planned.gpu_peak_bytes;
    j["planned_host_bytes"] = planned.host_bytes;
  }
  if (rank_env != nullptr) {
    // A rank of --context-parallel: its figures go to the parent, which prints the group's.
    j["rank"] = std::atoi(rank_env);
    j["context_parallel"] = context_parallel;
    j["sharded"] = shard;
    std::ofstream(result_path) << j.dump() << "\n";
    std::fprintf(stderr, "rank %s: %.3f s/step, GPU peak %s GiB\n", rank_env, sec, GiB(mem.peak_allocated).c_str());
    return 0;
  }
  std::printf("%s\n", j.dump().c_str());
  std::printf("| model | layers | seq | memory | GPU peak alloc / reserved GiB | pinned GiB | s/step | tok/s | MFU |\n");
  std::printf("| %s | %lld | %lld | %s%s%s | %s / %s | %s | %.2f | %.0f | %.1f%% |\n", o.model.c_str(),
              static_cast<long long>(cfg.num_hidden_layers), static_cast<long long>(S), o.memory.Describe().c_str(),
              o.memory.head_groups > 1 ? absl::StrFormat(" heads/%d", o.memory.head_groups).c_str() : "",
              odyssey::kernels::FusedKernelsEnabled() ? "" : " (reference ops)",
              GiB(mem.peak_allocated).c_str(), GiB(mem.peak_reserved).c_str(), GiB(t.memory().host_pool_bytes()).c_str(),
              sec, sec > 0 ? static_cast<double>(B * S) / sec : 0.0, sec > 0 ? 100.0 * flops / sec / kPeakFlops : 0.0);
  if (!phases.empty()) {
    const double total = std::accumulate(times.begin(), times.end(), 0.0) / steps;
    std::printf("| phase (per timed step; a phase includes the phases inside it) | scopes | seconds | of the step |\n");
    std::printf("| --- | --- | --- | --- |\n");
    for (const auto& p : phases) {
      std::printf("| %s | %lld | %.3f | %.1f%% |\n", p.kind.c_str(), static_cast<long long>(p.count / steps),
                  p.seconds / steps, total > 0 ? 100.0 * p.seconds / steps / total : 0.0);
    }
    if (phase_peak.bytes > 0)
      std::printf("GPU peak %s GiB reached in: %s\n", GiB(phase_peak.bytes).c_str(),
                  phase_peak.path.empty() ? "(outside every scope)" : phase_peak.path.c_str());
  }
  AppendJsonLine(json_path, j);
  return 0;
}
