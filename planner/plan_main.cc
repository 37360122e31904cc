// odyssey-plan: what the planner predicts and chooses for a model at a sequence length.
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "common/version.h"
#include "planner/planner.h"

int main(int argc, char** argv) {
  std::string model = "llama-3.2-3b";
  int64_t seq_len = 65536, layers = 0;
  double gpu_gib = 136, host_gib = 110;
  bool max = false, keep = false;
  odyssey::model::LoraConfig lora;
  CLI::App app{"odyssey-plan: predicted memory and the chosen strategy"};
  app.set_version_flag("--version", odyssey::VersionLine("odyssey-plan"));
  app.add_option("--model", model, "named shape or HF checkpoint dir")->capture_default_str();
  app.add_option("--seq-len", seq_len, "tokens")->capture_default_str();
  app.add_option("--layers", layers, "cut the model to this many layers (0 = all)")->capture_default_str();
  app.add_option("--gpu-gib", gpu_gib, "GPU memory the allocator may use")->capture_default_str();
  app.add_option("--host-gib", host_gib, "pinned host memory the pool may use")->capture_default_str();
  app.add_flag("--max", max, "print the longest sequence that fits");
  app.add_flag("--keep-attention", keep, "allow keeping attention outputs (skips the attention re-forward)");
  app.add_option("--lora-rank", lora.rank, "LoRA adapters of this rank, the base frozen (0 = full fine-tuning)")
      ->capture_default_str();
  app.add_option("--lora-targets", lora.target_modules,
                 "projections with adapters (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; default all)");
  CLI11_PARSE(app, argc, argv);
  auto config = odyssey::model::ResolveModelConfig(model);
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
  const auto shape = odyssey::planner::ShapeOf(*config, lora);
  if (max) {
    std::printf("longest sequence that fits: %lld tokens\n",
                static_cast<long long>(odyssey::planner::MaxSeqLen(shape, hw)));
  }
  odyssey::planner::ChooseOptions options;
  options.allow_keep_attention = keep;
  auto choice = odyssey::planner::Choose(shape, seq_len, 1, hw, options);
  if (!choice.ok()) {
    std::printf("%s\n", std::string(choice.status().message()).c_str());
    return 1;
  }
  std::printf("strategy: %s\n%s\n", choice->strategy.Describe().c_str(), choice->prediction.Describe().c_str());
  return 0;
}
