// odyssey-plan: what the planner predicts and chooses for a model at a sequence length.
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "common/version.h"
#include "planner/planner.h"

int main(int argc, char** argv) {
  std::string model = "llama-3.2-3b";
  int64_t seq_len = 65536, layers = 0, context_parallel = 1, head_groups = 0;
  double gpu_gib = 136, host_gib = 110;
  bool max = false, keep = false, shard = false;
  odyssey::model::LoraConfig lora;
  CLI::App app{"odyssey-plan: predicted memory and the chosen strategy"};
  app.set_version_flag("--version", odyssey::VersionLine("odyssey-plan"));
  app.add_option("--model", model, "named shape or HF checkpoint dir")->capture_default_str();
  app.add_option("--seq-len", seq_len, "tokens")->capture_default_str();
  app.add_option("--layers", layers, "cut the model to this many layers (0 = all)")->capture_default_str();
  app.add_option("--gpu-gib", gpu_gib, "GPU memory the allocator may use")->capture_default_str();
  app.add_option("--host-gib", host_gib, "pinned host memory the pool may use")->capture_default_str();
  app.add_flag("--max", max, "print the longest sequence that fits, then the plan at that length (at --seq-len when given)");
  app.add_option("--context-parallel", context_parallel,
                 "Ulysses ranks one sequence is spread over (one GPU each); the plan is per rank, at seq-len / P")
      ->capture_default_str();
  app.add_option("--head-groups", head_groups,
                 "fix the attention head groups (head-chunked attention; 1 = none; 0 = the planner's choice)")
      ->capture_default_str();
  app.add_flag("--shard", shard, "shard parameters, gradients and optimizer state over those ranks (ZeRO-3)");
  app.add_flag("--keep-attention", keep, "allow keeping attention outputs (skips the attention re-forward)");
  app.add_option("--lora-rank", lora.rank, "LoRA adapters of this rank, the base frozen (0 = full fine-tuning)")
      ->capture_default_str();
  app.add_option("--lora-targets", lora.target_modules,
                 "projections with adapters (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; default all)");
  std::string indexer_stage;
  app.add_option("--indexer-stage", indexer_stage,
                 "hybrid models with DSA layers: dense_warmup | sparse replaces the config's indexer stage (empty = the model's)");
  int64_t kda_chunk_size = 0;
  app.add_option("--kda-chunk-size", kda_chunk_size,
                 "hybrid models with KDA layers: 32 | 64 replaces the config's chunk size (0 = the model's)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  auto config =
      odyssey::model::ResolveModelConfig(model, odyssey::model::ModelOverrides{0, indexer_stage, kda_chunk_size}, "--");
  if (!config.ok()) {
    std::fprintf(stderr, "odyssey-plan: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  if (layers > 0) config->num_hidden_layers = layers;
  odyssey::planner::Hardware hw;
  hw.gpu_bytes = static_cast<int64_t>(gpu_gib * (1 << 30));
  hw.host_bytes = static_cast<int64_t>(host_gib * (1 << 30));
  if (absl::Status s = lora.Validate("--lora", &*config); !s.ok()) {
    std::fprintf(stderr, "odyssey-plan: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (context_parallel < 1 || config->num_attention_heads % context_parallel != 0) {
    std::fprintf(stderr, "odyssey-plan: --context-parallel (%lld) must be >= 1 and divide the query heads (%lld)\n",
                 static_cast<long long>(context_parallel), static_cast<long long>(config->num_attention_heads));
    return 2;
  }
  if (shard && lora.enabled()) {
    std::fprintf(stderr, "odyssey-plan: --shard with --lora-rank is not implemented (CreateJob refuses it)\n");
    return 2;
  }
  auto shape = odyssey::planner::ShapeOf(*config, lora);
  if (shard) shape.shard_ranks = context_parallel;
  shape.context_ranks = context_parallel;
  // P ranks of one sequence all-reduce after the backward: no gradient leaves the GPU early.
  shape.gradients_to_step = odyssey::planner::GradientsToStep(false, context_parallel);
  const int64_t P = context_parallel;
  odyssey::planner::ChooseOptions options;
  options.allow_keep_attention = keep;
  if (head_groups < 0) {
    std::fprintf(stderr, "odyssey-plan: --head-groups (%lld) must be >= 0\n", static_cast<long long>(head_groups));
    return 2;
  }
  if (head_groups > 0) options.fixed.head_groups = head_groups;
  if (max) {
    // Each rank holds S / P positions: the longest per rank, times P.
    const int64_t per_rank = odyssey::planner::MaxSeqLen(shape, hw, 16384, options);
    if (P > 1) {
      std::printf("longest sequence that fits: %lld tokens (%lld ranks x %lld)\n",
                  static_cast<long long>(per_rank * P), static_cast<long long>(P), static_cast<long long>(per_rank));
    } else {
      std::printf("longest sequence that fits: %lld tokens\n", static_cast<long long>(per_rank));
    }
    // The plan below is the one at that length unless a length was asked for.
    if (app.count("--seq-len") == 0) seq_len = per_rank * P;
  }
  if (seq_len % P != 0) {
    std::fprintf(stderr, "odyssey-plan: --context-parallel (%lld) must divide --seq-len (%lld)\n",
                 static_cast<long long>(P), static_cast<long long>(seq_len));
    return 2;
  }
  seq_len /= P;  // the plan of one rank
  auto choice = odyssey::planner::Choose(shape, seq_len, 1, hw, options);
  if (!choice.ok()) {
    std::printf("%s\n", std::string(choice.status().message()).c_str());
    return 1;
  }
  std::printf("strategy: %s\n%s\n", choice->strategy.Describe().c_str(), choice->prediction.Describe().c_str());
  return 0;
}
