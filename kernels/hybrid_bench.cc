// odyssey-hybrid-bench: the hybrid layers' attention paths on one CUDA device, at hybrid-3b's
// shapes (or the flags'), forward and forward + backward:
//   - KDA: kernels::KdaChunked (C = 64) over T tokens, 24 heads of 128, bf16 inputs, with its
//     CUDA kernels (scans, chunk quantities, intra-chunk backward), the same in fp32 on CUDA cores
//     instead of TF32 on the tensor cores (SetKdaScanTensorCores(false): the scans, the chunk
//     gradients and the intra-chunk backward's products), the same with the intra-chunk backward by
//     libtorch ops, and, up to --reference-tokens, libtorch throughout; the same shapes as bench/fla_kda_bench.py times
//     fla's chunk_kda with. --variants picks which of those run (0 kernels, 1 fp32 on CUDA cores, 2 intra
//     backward by libtorch, 3 libtorch; all by default), --chunk 32|64 and --segment the KdaOptions
//     (64 and 32768 by default); --kda-direct on|off whether the kernels read the caller's inputs
//     directly (on, the default) or prepared fp32 copies (kernels::SetKdaDirectInputs);
//     --kda-scan-operands tf32|bf16 whether the forward's state scan reads qg, kg and W as bf16
//     (kernels::SetKdaScanBf16Operands; the library's default otherwise) and --kda-scan-value-block
//     32|16 the value columns a block of that scan owns (SetKdaScanValueBlock);
//     --kda-backward-inverse read|recompute whether the intra backward kernel reads the recompute's
//     UT inverse or inverts again (kernels::SetKdaIntraBackwardReadsInverse). --gate
//     mild|strong picks the log-decay (below); --profile DIR
//     records one more forward + backward at the last length into DIR/kda_trace.json.
//   - sparse attention: kernels::SparseAttention over W selected keys per query (GQA 24/8 x 128),
//     its CUDA kernels and (up to --reference-tokens) its libtorch path, --selection pools (the
//     default: DSA's, the indexer's top W / 4 pools of 4 keys and the tail), window (the W keys
//     up to each query) or random (uniform over the causal prefix, per query), against
//     dense SDPA (cuDNN/flash through ATen) over the same number of keys (queries of a W-token
//     window attending to all of it), as TFLOP/s of the work each does:
//     4 * H * D FLOP per selected (query, key) pair forward, 2.5x that forward + backward.
//   - indexer: kernels::IndexerTopK, GLM's lightning indexer over pools of 4 keys (32 index heads
//     of 128, top --selected / 4 pools), its CUDA kernels and (up to --reference-tokens) the
//     libtorch streaming selection; TFLOP/s of the causal scoring, 2 * HI * DI FLOP per visible
//     (query, pool) pair.
//   - kl: kernels::IndexerKlLoss, the indexer's KL over its top --selected / 4 pools (a random
//     target), its CUDA kernels and its libtorch path, forward and forward + backward.
//   - warmup: kernels::DenseWarmupKl, the dense warm-up's KL (the main attention's pooled
//     probabilities as the target, over every visible pool), the value alone (a checkpoint's
//     first forward) and the value with its gradients + backward (the recompute's), at each query
//     block size of --warmup-blocks (0, the default: DenseWarmupKlBlock's choice), with the time
//     per block: the target by its CUDA kernels at each size, by libtorch at the first; --profile
//     DIR records one more (CUDA kernels) at the last length and the first block size into
//     DIR/warmup_trace.json.
// The sparse attention's CUDA kernels run twice: on the tensor cores (bf16 products, the
// default) and on CUDA cores (kernels::SetSparseTensorCores(false)).
// One JSON line per row with --json.
//
//   build-gpu/kernels/odyssey-hybrid-bench --tokens 65536,262144 --ops kda,sparse,dense --json out/hybrid.jsonl
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "common/wire_text.h"
#include "engine/profiler.h"
#include "kernels/dsa.h"
#include "kernels/fused_ops.h"
#include "kernels/kda.h"

namespace {

double Seconds(const std::function<void()>& f, int iters) {
  f();  // warm-up (allocator, cuDNN plans)
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  torch::cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

void Json(const std::string& path, const std::string& line) {
  if (path.empty()) return;
  std::ofstream(path, std::ios::app) << line << "\n";
}

// A whole integer: std::stoll alone reads "64k" as 64. Throws std::invalid_argument or
// std::out_of_range (the flag loop names the flag).
int64_t ParseInt(const std::string& s) {
  size_t used = 0;
  const long long v = std::stoll(s, &used);
  if (used != s.size()) throw std::invalid_argument(s);
  return v;
}

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(ParseInt(item));
  if (out.empty()) throw std::invalid_argument(s);
  return out;
}

// The lightning indexer's inputs at T tokens (random index queries, pooled keys and head
// weights, `heads` heads of `dim`) and its options for the top selected / 4 pools of 4 keys.
struct IndexerInputs {
  torch::Tensor q, keys, w;
  odyssey::kernels::DsaIndexerOptions options;
};
IndexerInputs RandomIndexerInputs(int64_t T, int64_t heads, int64_t dim, int64_t selected,
                                  const torch::TensorOptions& opts) {
  IndexerInputs in;
  in.q = torch::randn({1, heads, T, dim}, opts);
  in.keys = torch::randn({1, T / 4, dim}, opts);
  in.w = torch::randn({1, T, heads}, opts) / std::sqrt(static_cast<double>(heads));
  in.options.top_k = selected / 4;
  in.options.pool = 4;
  return in;
}

// Runs f once more under the profiler (every kernel and the code's phases) into dir/file, for
// bench/profile_report.py; false (the reason on stderr) when the profiler failed.
bool ProfileOnce(const std::string& dir, const std::string& file, const std::function<void()>& f, const char* what,
                 int64_t tokens) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string trace = dir + "/" + file;
  if (absl::Status st = odyssey::engine::StartProfile(/*cuda=*/true, /*memory=*/false); !st.ok()) {
    std::fprintf(stderr, "odyssey-hybrid-bench: %s\n", std::string(st.message()).c_str());
    return false;
  }
  f();
  torch::cuda::synchronize();
  if (absl::Status st = odyssey::engine::StopProfile(trace); !st.ok()) {
    std::fprintf(stderr, "odyssey-hybrid-bench: %s\n", std::string(st.message()).c_str());
    return false;
  }
  std::fprintf(stderr, "odyssey-hybrid-bench: profiled %s at %lld tokens: %s\n", what, static_cast<long long>(tokens),
               trace.c_str());
  return true;
}

int Run(int argc, char** argv) {
  std::vector<int64_t> tokens = {65536, 262144};
  int64_t heads = 24, kv_heads = 8, dim = 128, selected = 2048, iters = 3, reference_tokens = 65536;
  int64_t index_heads = 32, index_dim = 128;
  std::string json, ops = "kda,sparse,dense", gate = "mild", profile_dir, selection = "pools", kda_direct = "on";
  std::string kda_scan_operands = odyssey::kernels::KdaScanBf16Operands() ? "bf16" : "tf32";
  int64_t kda_value_block = 32;
  std::string kda_backward_inverse = odyssey::kernels::KdaIntraBackwardReadsInverse() ? "read" : "recompute";
  std::vector<int64_t> warmup_blocks = {0};
  std::vector<int64_t> kda_variants = {0, 1, 2, 3};
  odyssey::kernels::KdaOptions kda_options;
  // A refused flag: its message on stderr, exit 2 (the value quoted through WireText by callers).
  auto refuse = [](const std::string& message) {
    std::fprintf(stderr, "odyssey-hybrid-bench: %s\n", message.c_str());
    return 2;
  };
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    try {
      if (a == "--tokens") tokens = ParseList(v);
      else if (a == "--heads") heads = ParseInt(v);
      else if (a == "--kv-heads") kv_heads = ParseInt(v);
      else if (a == "--dim") dim = ParseInt(v);
      else if (a == "--selected") selected = ParseInt(v);
      else if (a == "--iters") iters = ParseInt(v);
      else if (a == "--json") json = v;
      else if (a == "--ops") ops = "," + v + ",";
      else if (a == "--reference-tokens") reference_tokens = ParseInt(v);
      else if (a == "--gate") gate = v;
      else if (a == "--profile") profile_dir = v;
      else if (a == "--selection") selection = v;
      else if (a == "--warmup-blocks") warmup_blocks = ParseList(v);
      else if (a == "--chunk") kda_options.chunk_size = ParseInt(v);
      else if (a == "--segment") kda_options.segment = ParseInt(v);
      else if (a == "--kda-direct") kda_direct = v;
      else if (a == "--kda-scan-operands") kda_scan_operands = v;
      else if (a == "--kda-scan-value-block") kda_value_block = ParseInt(v);
      else if (a == "--kda-backward-inverse") kda_backward_inverse = v;
      else if (a == "--variants") kda_variants = ParseList(v);
      else
        return refuse(absl::StrCat("unknown flag ", odyssey::WireText(a),
                                   " (--tokens, --heads, --kv-heads, --dim, --selected, --iters, --ops, --reference-tokens, "
                                   "--gate, --profile, --selection, --warmup-blocks, --chunk, --segment, --kda-direct, "
                                   "--kda-scan-operands, --kda-scan-value-block, --kda-backward-inverse, --variants, "
                                   "--json)"));
    } catch (const std::logic_error&) {  // std::stoll's invalid_argument and out_of_range
      return refuse(absl::StrCat(a, ": ", odyssey::WireText(v), " is not an integer (or a comma-separated list of them)"));
    }
  }
  if (argc % 2 == 0) return refuse(absl::StrCat(odyssey::WireText(argv[argc - 1]), " needs a value"));  // no value
  for (const auto& [name, value] : std::vector<std::pair<const char*, int64_t>>{
           {"--heads", heads}, {"--kv-heads", kv_heads}, {"--dim", dim}, {"--selected", selected}, {"--iters", iters}}) {
    if (value < 1) return refuse(absl::StrCat(name, ": ", value, " must be at least 1"));
  }
  if (heads % kv_heads != 0)
    return refuse(absl::StrCat("--kv-heads: ", kv_heads, " does not divide --heads (", heads, ")"));
  for (int64_t T : tokens) {
    if (T < 1) return refuse(absl::StrCat("--tokens: ", T, " must be at least 1"));
  }
  if (gate != "mild" && gate != "strong")
    return refuse(absl::StrCat("--gate: ", odyssey::WireText(gate), " is neither mild nor strong"));
  if (selection != "window" && selection != "random" && selection != "pools")
    return refuse(absl::StrCat("--selection: ", odyssey::WireText(selection), " is not one of window, random, pools"));
  if (ops.front() != ',') ops = "," + ops + ",";
  {
    std::stringstream in(ops.substr(1));
    std::string op;
    while (std::getline(in, op, ',')) {
      if (!op.empty() && op != "kda" && op != "sparse" && op != "dense" && op != "indexer" && op != "kl" &&
          op != "warmup")
        return refuse(absl::StrCat("--ops: unknown op ", odyssey::WireText(op), " (kda, sparse, dense, indexer, kl, warmup)"));
    }
  }
  if (kda_options.chunk_size != 32 && kda_options.chunk_size != 64)
    return refuse(absl::StrCat("--chunk: ", kda_options.chunk_size, " is neither 32 nor 64 (the sizes KDA's kernels take)"));
  if (kda_options.segment <= 0 || kda_options.segment % kda_options.chunk_size != 0)
    return refuse(absl::StrCat("--segment: ", kda_options.segment, " is not a positive multiple of the chunk (",
                               kda_options.chunk_size, ")"));
  if (kda_direct != "on" && kda_direct != "off")
    return refuse(absl::StrCat("--kda-direct: ", odyssey::WireText(kda_direct), " is neither on nor off"));
  odyssey::kernels::SetKdaDirectInputs(kda_direct == "on");
  if (kda_scan_operands != "tf32" && kda_scan_operands != "bf16") {
    return refuse(
        absl::StrCat("--kda-scan-operands: ", odyssey::WireText(kda_scan_operands), " is neither tf32 nor bf16"));
  }
  if ((kda_value_block != 16 && kda_value_block != 32) ||
      !odyssey::kernels::SetKdaScanValueBlock(static_cast<int>(kda_value_block))) {
    return refuse(absl::StrCat("--kda-scan-value-block: ", kda_value_block, " is neither 32 nor 16"));
  }
  odyssey::kernels::SetKdaScanBf16Operands(kda_scan_operands == "bf16");
  if (kda_backward_inverse != "read" && kda_backward_inverse != "recompute") {
    return refuse(absl::StrCat("--kda-backward-inverse: ", odyssey::WireText(kda_backward_inverse),
                               " is neither read nor recompute"));
  }
  odyssey::kernels::SetKdaIntraBackwardReadsInverse(kda_backward_inverse == "read");
  for (int64_t variant : kda_variants) {
    if (variant < 0 || variant > 3)
      return refuse(absl::StrCat("--variants: ", variant,
                                 " is not one of 0 (CUDA kernels), 1 (fp32 on CUDA cores), 2 (intra backward by "
                                 "libtorch), 3 (libtorch)"));
  }
  for (int64_t b : warmup_blocks) {
    if (b < 0) return refuse(absl::StrCat("--warmup-blocks: ", b, " is negative (0 = the library's choice)"));
  }
  // Every flag checked first, so a bad one is refused on any machine.
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "odyssey-hybrid-bench: needs a CUDA device\n");
    return 1;
  }
  auto wants = [&](const char* op) { return ops.find("," + std::string(op) + ",") != std::string::npos; };
  torch::manual_seed(0);
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  std::printf("| op | tokens | forward ms | forward + backward ms | tok/s (fwd + bwd) | TFLOP/s (fwd + bwd) |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  for (int64_t T : tokens) {
    // KDA, (B, H, T, K) layout; q, k L2-normalised, log-decay g < 0 near 0, beta in (0, 1).
    // 0: every CUDA kernel (TF32 products on the tensor cores); 1: the same in fp32 on CUDA
    // cores (SetKdaScanTensorCores(false): the scans of kernels/cuda/kda_scan.cu, the chunk
    // gradients as fp32 matmuls, the intra-chunk backward's 4 x 4 thread tiles); 2: the intra-chunk
    // backward by libtorch ops (what kernels/cuda/kda_intra_backward.h replaces); 3: libtorch
    // throughout.
    for (int64_t variant : kda_variants) {
      const bool kernels = variant < 3;
      if (!wants("kda") || (!kernels && T > reference_tokens)) continue;
      if (kernels && !odyssey::kernels::FusedKernelsBuilt()) continue;
      odyssey::kernels::SetFusedKernels(kernels);
      odyssey::kernels::SetKdaScanTensorCores(variant != 1);
      odyssey::kernels::SetKdaIntraBackwardPath(variant == 2 ? odyssey::kernels::KdaIntraBackwardPath::kLibtorch
                                                             : odyssey::kernels::KdaIntraBackwardPath::kAuto);
      const char* name = variant == 0   ? "CUDA kernels"
                         : variant == 1 ? "CUDA kernels, fp32 on CUDA cores (no TF32)"
                         : variant == 2 ? "CUDA kernels, intra backward by libtorch"
                                        : "libtorch";
      const char* json_op = variant == 0   ? "kda_chunked_kernel"
                            : variant == 1 ? "kda_chunked_kernel_fp32_scans"
                            : variant == 2 ? "kda_chunked_kernel_libtorch_intra_backward"
                                           : "kda_chunked_libtorch";
      auto q = torch::nn::functional::normalize(torch::randn({1, heads, T, dim}, bf16),
                                                torch::nn::functional::NormalizeFuncOptions().dim(-1));
      auto k = torch::nn::functional::normalize(torch::randn({1, heads, T, dim}, bf16),
                                                torch::nn::functional::NormalizeFuncOptions().dim(-1));
      auto v = torch::randn({1, heads, T, dim}, bf16);
      // mild: logsigmoid(x + 4), ~0.025 e-folds a token (a chunk of 64 decays ~1.6: the Grams'
      // whole-chunk form); strong: the safe gate's range, -5 sigmoid(x), ~2.5 a token (~160 a
      // chunk, ~40 a 16-token sub-block: the sub-block form).
      auto x = torch::randn({1, heads, T, dim}, bf16.dtype(torch::kFloat32));
      auto g = gate == "mild" ? torch::log_sigmoid(x + 4.0) : -5.0 * torch::sigmoid(x);
      auto beta = torch::sigmoid(torch::randn({1, heads, T}, bf16));
      for (auto* t : {&q, &k, &v, &g, &beta}) t->requires_grad_(true);
      auto dout = torch::randn({1, heads, T, dim}, bf16);
      const double fwd = Seconds([&] {
        torch::NoGradGuard no_grad;
        odyssey::kernels::KdaChunked(q, k, v, g, beta, torch::Tensor(), kda_options);
      }, static_cast<int>(iters));
      auto forward_backward = [&] {
        auto [o, state] = odyssey::kernels::KdaChunked(q, k, v, g, beta, torch::Tensor(), kda_options);
        torch::autograd::backward({o}, {dout});
        for (auto* t : {&q, &k, &v, &g, &beta}) t->mutable_grad() = torch::Tensor();
      };
      const double both = Seconds(forward_backward, static_cast<int>(iters));
      // The forward scan's operands where they are bf16 (variants 0 and 2: the tensor-core scans).
      const std::string operands =
          odyssey::kernels::KdaScanBf16Operands() && variant != 1
              ? absl::StrCat(", bf16 scan operands, value block ", kda_value_block)
              : "";
      std::printf("| KDA chunked, %s%s, %s gate | %lld | %.1f | %.1f | %.0f | |\n", name, operands.c_str(),
                  gate.c_str(), static_cast<long long>(T), fwd * 1e3, both * 1e3, static_cast<double>(T) / both);
      std::fflush(stdout);
      if (!profile_dir.empty() && variant == 0 && T == tokens.back()) {
        // One more forward + backward under the profiler: kda.cc's phases ("kda forward",
        // "kda backward: ...") and every kernel; bench/profile_report.py summarizes the trace.
        if (!ProfileOnce(profile_dir, "kda_trace.json", forward_backward, "one KDA forward + backward", T)) return 1;
      }
      odyssey::kernels::SetFusedKernels(true);
      odyssey::kernels::SetKdaScanTensorCores(true);
      odyssey::kernels::SetKdaIntraBackwardPath(odyssey::kernels::KdaIntraBackwardPath::kAuto);
      Json(json, std::string("{\"op\":\"") + json_op + "\",\"gate\":\"" + gate + "\",\"tokens\":" + std::to_string(T) + ",\"heads\":" + std::to_string(heads) +
                     ",\"dim\":" + std::to_string(dim) + ",\"chunk\":" + std::to_string(kda_options.chunk_size) +
                     ",\"segment\":" + std::to_string(kda_options.segment) +
                     ",\"scan_operand_storage\":\"" + (operands.empty() ? "fp32" : "bf16") + "\",\"value_block\":" +
                     std::to_string(kda_value_block) + ",\"backward_inverse\":\"" + kda_backward_inverse +
                     "\",\"forward_ms\":" + std::to_string(fwd * 1e3) +
                     ",\"forward_backward_ms\":" + std::to_string(both * 1e3) + "}");
    }
    // The lightning indexer's selection: top selected / 4 pools of 4 keys per query.
    for (bool kernels : {true, false}) {
      if (!wants("indexer") || (!kernels && T > reference_tokens)) continue;
      if (kernels && !odyssey::kernels::FusedKernelsBuilt()) continue;
      odyssey::kernels::SetFusedKernels(kernels);
      const IndexerInputs in = RandomIndexerInputs(T, index_heads, index_dim, selected, bf16);
      const odyssey::kernels::DsaIndexerOptions& o = in.options;
      const double t =
          Seconds([&] { odyssey::kernels::IndexerTopK(in.q, in.keys, in.w, o); }, static_cast<int>(iters));
      odyssey::kernels::SetFusedKernels(true);
      // Visible (query, pool) pairs: query t sees floor((t + 1) / 4) pools.
      const double pairs = static_cast<double>(T / 4) * static_cast<double>(T / 4 + 1) * 2.0;
      const double flop = 2.0 * index_heads * index_dim * pairs;
      std::printf("| indexer top-%lld pools (%s), %lld x %lld heads | %lld | %.1f | | %.0f | %.1f |\n",
                  static_cast<long long>(o.top_k), kernels ? "CUDA kernels" : "libtorch",
                  static_cast<long long>(index_heads), static_cast<long long>(index_dim), static_cast<long long>(T),
                  t * 1e3, static_cast<double>(T) / t, flop / t / 1e12);
      std::fflush(stdout);
      Json(json, std::string("{\"op\":\"") + (kernels ? "indexer_kernel" : "indexer_libtorch") +
                     "\",\"tokens\":" + std::to_string(T) + ",\"top_pools\":" + std::to_string(o.top_k) +
                     ",\"forward_ms\":" + std::to_string(t * 1e3) + ",\"tflops\":" + std::to_string(flop / t / 1e12) +
                     "}");
    }
    // The indexer's KL loss over its selected pools (the DSA layer's sparse stage): forward, and
    // forward + backward, the CUDA kernels against libtorch (which runs at every length: it works a
    // block of rows at a time).
    for (bool kernels : {true, false}) {
      if (!wants("kl") || (kernels && !odyssey::kernels::FusedKernelsBuilt())) continue;
      odyssey::kernels::SetFusedKernels(true);
      const IndexerInputs in = RandomIndexerInputs(T, index_heads, index_dim, selected, bf16);
      const torch::Tensor pool = odyssey::kernels::IndexerTopK(in.q, in.keys, in.w, in.options);
      torch::Tensor target = torch::rand(pool.sizes(), in.q.options().dtype(torch::kFloat32))
                                 .masked_fill(pool < 0, 0.0);
      target = target / target.sum(-1, true).clamp_min(1e-30);
      odyssey::kernels::SetFusedKernels(kernels);
      auto q = in.q.detach().requires_grad_(true), k = in.keys.detach().requires_grad_(true),
           w = in.w.detach().requires_grad_(true);
      const double fwd = Seconds([&] {
        torch::NoGradGuard no_grad;
        odyssey::kernels::IndexerKlLoss(q, k, w, pool, target);
      }, static_cast<int>(iters));
      const double both = Seconds([&] {
        odyssey::kernels::IndexerKlLoss(q, k, w, pool, target).backward();
        for (auto* t : {&q, &k, &w}) t->mutable_grad() = torch::Tensor();
      }, static_cast<int>(iters));
      odyssey::kernels::SetFusedKernels(true);
      std::printf("| indexer KL over top-%lld pools (%s), %lld x %lld heads | %lld | %.1f | %.1f | %.0f | |\n",
                  static_cast<long long>(in.options.top_k), kernels ? "CUDA kernels" : "libtorch",
                  static_cast<long long>(index_heads), static_cast<long long>(index_dim), static_cast<long long>(T),
                  fwd * 1e3, both * 1e3, static_cast<double>(T) / both);
      std::fflush(stdout);
      Json(json, std::string("{\"op\":\"") + (kernels ? "indexer_kl_kernel" : "indexer_kl_libtorch") +
                     "\",\"tokens\":" + std::to_string(T) + ",\"top_pools\":" + std::to_string(in.options.top_k) +
                     ",\"forward_ms\":" + std::to_string(fwd * 1e3) +
                     ",\"forward_backward_ms\":" + std::to_string(both * 1e3) + "}");
    }
    // The dense warm-up's KL at each block size: the target from the main attention's q and k
    // (GQA heads / kv_heads of dim), the indexer's q, pooled keys and w differentiable.
    // The target by the CUDA kernels at every block size, then by libtorch at the first.
    std::vector<std::pair<size_t, bool>> warmup_runs;
    for (size_t bi = 0; bi < warmup_blocks.size(); ++bi) {
      if (odyssey::kernels::FusedKernelsBuilt()) warmup_runs.emplace_back(bi, true);
    }
    if (!warmup_blocks.empty()) warmup_runs.emplace_back(0, false);
    for (const auto& [bi, kernels] : warmup_runs) {
      if (!wants("warmup")) break;
      odyssey::kernels::SetFusedKernels(kernels);
      const IndexerInputs in = RandomIndexerInputs(T, index_heads, index_dim, selected, bf16);
      const torch::Tensor q = torch::randn({1, heads, T, dim}, bf16), k = torch::randn({1, kv_heads, T, dim}, bf16);
      const int64_t block =
          warmup_blocks[bi] > 0 ? warmup_blocks[bi] : odyssey::kernels::DenseWarmupKlBlockFor(in.q, q, k);
      auto qi = in.q.detach().requires_grad_(true), keys = in.keys.detach().requires_grad_(true),
           w = in.w.detach().requires_grad_(true);
      const auto value = [&] {
        torch::NoGradGuard no_grad;
        odyssey::kernels::DenseWarmupKl(qi, keys, w, q, k, block);
      };
      const auto value_and_grads = [&] {
        odyssey::kernels::DenseWarmupKl(qi, keys, w, q, k, block).backward();
        for (auto* t : {&qi, &keys, &w}) t->mutable_grad() = torch::Tensor();
      };
      const double fwd = Seconds(value, static_cast<int>(iters));
      const double both = Seconds(value_and_grads, static_cast<int>(iters));
      const int64_t blocks = (T + block - 1) / block;
      std::printf("| dense warm-up KL, target by %s, %lld-row blocks (%lld), target %lld/%lld x %lld, indexer %lld x "
                  "%lld | %lld | %.1f | %.1f | %.0f | |\n",
                  kernels ? "CUDA kernels" : "libtorch", static_cast<long long>(block), static_cast<long long>(blocks),
                  static_cast<long long>(heads),
                  static_cast<long long>(kv_heads), static_cast<long long>(dim), static_cast<long long>(index_heads),
                  static_cast<long long>(index_dim), static_cast<long long>(T), fwd * 1e3, both * 1e3,
                  static_cast<double>(T) / both);
      std::printf("|   (per block: %.3f ms value, %.3f ms value + gradients + backward) | | | | | |\n",
                  fwd * 1e3 / blocks, both * 1e3 / blocks);
      std::fflush(stdout);
      Json(json, std::string("{\"op\":\"") + (kernels ? "dense_warmup_kl_kernel" : "dense_warmup_kl_libtorch") +
                     "\",\"tokens\":" + std::to_string(T) + ",\"block\":" + std::to_string(block) +
                     ",\"blocks\":" + std::to_string(blocks) + ",\"forward_ms\":" + std::to_string(fwd * 1e3) +
                     ",\"forward_backward_ms\":" + std::to_string(both * 1e3) + "}");
      if (!profile_dir.empty() && bi == 0 && kernels == odyssey::kernels::FusedKernelsBuilt() && T == tokens.back()) {
        if (!ProfileOnce(profile_dir, "warmup_trace.json", value_and_grads, "one dense warm-up KL with gradients", T))
          return 1;
      }
      odyssey::kernels::SetFusedKernels(true);
    }
    // Sparse attention over `selected` keys per query against dense SDPA over as many: the CUDA
    // kernels, and up to --reference-tokens the libtorch path.
    // The CUDA kernels on the tensor cores, the same on CUDA cores, then libtorch.
    for (const auto& [kernels, tensor_cores] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, false}}) {
      if (!wants("sparse") || (!kernels && T > reference_tokens)) continue;
      if (kernels && !odyssey::kernels::FusedKernelsBuilt()) continue;
      odyssey::kernels::SetFusedKernels(kernels);
      odyssey::kernels::SetSparseTensorCores(tensor_cores);
      const std::string path = !kernels ? "libtorch" : tensor_cores ? "CUDA kernels, tensor cores" : "CUDA kernels, CUDA cores";
      auto q = torch::randn({1, heads, T, dim}, bf16).requires_grad_(true);
      auto k = torch::randn({1, kv_heads, T, dim}, bf16).requires_grad_(true);
      auto v = torch::randn({1, kv_heads, T, dim}, bf16).requires_grad_(true);
      auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(torch::kCUDA);
      auto t_idx = torch::arange(T, i64).view({T, 1});
      torch::Tensor idx;
      if (selection == "window") {
        // Query t selects the `selected` keys up to itself, in increasing order (fewer, padded
        // with -1, near the start): neighbours share all but one key, the cache's best case.
        idx = t_idx - torch::arange(selected - 1, -1, -1, i64).view({1, selected});
        idx = torch::where(idx >= 0, idx, torch::full_like(idx, -1));
      } else if (selection == "pools") {
        // DSA's own selection: the lightning indexer's top selected / 4 pools of 4 keys (random
        // index queries and keys, hybrid-3b's 32 heads of 128), expanded with the tail.
        const IndexerInputs in = RandomIndexerInputs(T, index_heads, index_dim, selected, bf16);
        idx = odyssey::kernels::ExpandPoolSelection(odyssey::kernels::IndexerTopK(in.q, in.keys, in.w, in.options))
                  .squeeze(0);
      } else {
        // Uniform over the causal prefix, independently per query: the cache's worst case.
        // (Rare repeats in short prefixes cost the same as distinct keys.)
        idx = (torch::rand({T, selected}, i64.dtype(torch::kFloat32)) * (t_idx + 1).to(torch::kFloat32))
                  .to(torch::kInt64)
                  .clamp_max(t_idx);
      }
      idx = idx.to(torch::kInt32).unsqueeze(0);
      auto dout = torch::randn({1, heads, T, dim}, bf16);
      const double fwd = Seconds([&] {
        torch::NoGradGuard no_grad;
        odyssey::kernels::SparseAttention(q, k, v, idx);
      }, static_cast<int>(iters));
      const double both = Seconds([&] {
        auto o = odyssey::kernels::SparseAttention(q, k, v, idx);
        torch::autograd::backward({o}, {dout});
        for (auto* t : {&q, &k, &v}) t->mutable_grad() = torch::Tensor();
      }, static_cast<int>(iters));
      // The indexer KL's target: the head-mean probabilities at the selected keys, given the
      // forward's log-sum-exp (one walk over the selection, as the DSA layer runs it).
      double probs = 0.0;
      if (kernels) {
        torch::NoGradGuard no_grad;
        const torch::Tensor lse = odyssey::kernels::SparseAttentionForward(q, k, v, idx).lse;
        probs = Seconds([&] { odyssey::kernels::SparseAttentionProbs(q, k, idx, 0.0, 64, lse); },
                        static_cast<int>(iters));
      }
      odyssey::kernels::SetFusedKernels(true);
      odyssey::kernels::SetSparseTensorCores(true);
      // The (query, key) pairs the selection holds (fewer than T * selected near the start).
      const double flop = 4.0 * heads * dim * (idx >= 0).sum().item<double>();
      std::printf("| sparse attention (%s), %lld keys, %s selection | %lld | %.1f (%.1f TFLOP/s) | %.1f | %.0f | %.1f |\n",
                  path.c_str(), static_cast<long long>(selected), selection.c_str(),
                  static_cast<long long>(T), fwd * 1e3, flop / fwd / 1e12, both * 1e3, static_cast<double>(T) / both,
                  2.5 * flop / both / 1e12);
      if (kernels) {
        std::printf("| sparse attention probabilities given lse (%s), %lld keys, %s selection | %lld | %.1f |\n",
                    path.c_str(), static_cast<long long>(selected), selection.c_str(), static_cast<long long>(T),
                    probs * 1e3);
      }
      std::fflush(stdout);
      Json(json, std::string("{\"op\":\"") +
                     (!kernels ? "sparse_attention_libtorch"
                               : tensor_cores ? "sparse_attention_kernel_tensor_cores" : "sparse_attention_kernel") +
                     "\",\"selection\":\"" + selection + "\",\"tokens\":" + std::to_string(T) + ",\"selected\":" +
                     std::to_string(selected) + ",\"forward_ms\":" + std::to_string(fwd * 1e3) +
                     ",\"forward_backward_ms\":" + std::to_string(both * 1e3) +
                     ",\"tflops_fwd_bwd\":" + std::to_string(2.5 * flop / both / 1e12) +
                     (kernels ? ",\"probs_ms\":" + std::to_string(probs * 1e3) : std::string()) + "}");
    }
  }
  // Dense SDPA over the same key count: windows of `selected` tokens, every query attending to
  // the whole window (no mask), T / selected windows as the batch: `selected` keys per query.
  for (int64_t T : tokens) {
    if (!wants("dense")) break;
    const int64_t windows = T / selected;
    auto q = torch::randn({windows, heads, selected, dim}, bf16).requires_grad_(true);
    auto k = torch::randn({windows, heads, selected, dim}, bf16).requires_grad_(true);
    auto v = torch::randn({windows, heads, selected, dim}, bf16).requires_grad_(true);
    auto dout = torch::randn({windows, heads, selected, dim}, bf16);
    const double fwd = Seconds([&] {
      torch::NoGradGuard no_grad;
      at::scaled_dot_product_attention(q, k, v);
    }, static_cast<int>(iters));
    const double both = Seconds([&] {
      auto o = at::scaled_dot_product_attention(q, k, v);
      torch::autograd::backward({o}, {dout});
      for (auto* t : {&q, &k, &v}) t->mutable_grad() = torch::Tensor();
    }, static_cast<int>(iters));
    const double flop = 4.0 * heads * dim * static_cast<double>(selected) * static_cast<double>(windows * selected);
    std::printf("| dense SDPA, %lld keys per query | %lld | %.1f | %.1f | %.0f | %.1f |\n", static_cast<long long>(selected),
                static_cast<long long>(windows * selected), fwd * 1e3, both * 1e3,
                static_cast<double>(windows * selected) / both, 2.5 * flop / both / 1e12);
    std::fflush(stdout);
    Json(json, "{\"op\":\"dense_sdpa_window\",\"tokens\":" + std::to_string(windows * selected) + ",\"selected\":" +
                   std::to_string(selected) + ",\"forward_ms\":" + std::to_string(fwd * 1e3) +
                   ",\"forward_backward_ms\":" + std::to_string(both * 1e3) +
                   ",\"tflops_fwd_bwd\":" + std::to_string(2.5 * flop / both / 1e12) + "}");
  }
  return 0;
}

}  // namespace

// An exception (CUDA out of memory at a length the card cannot hold, a kernel's launch error)
// ends the bench with its message, libtorch's stack trace cut (common/wire_text.h), and exit 1;
// the rows printed before it stand.
int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "odyssey-hybrid-bench: stopped: %s\n", odyssey::WireText(e.what()).c_str());
    return 1;
  }
}
