// odyssey-train: train a model on one device. The defaults are the embedded demo: the tiny
// byte-level model on the King James Bible text, on the CPU when there is no GPU.
#include <cmath>
#include <cstdio>
#include <string>

#include <torch/torch.h>

#include "CLI/CLI.hpp"
#include "engine/trainer.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/version.h"
#include "model/config.h"

int main(int argc, char** argv) {
  odyssey::engine::TrainerOptions o;
  o.steps = 400;
  o.optimizer.lr = 3e-3;
  o.optimizer.weight_decay = 0.0;
  o.schedule.warmup_steps = 20;
  o.data.seq_len = 256;
  o.data.batch_size = 8;
  std::string out_dir;
  std::string resume;
  int64_t log_every = 10;
  int threads = 0;

  CLI::App app{"odyssey-train: train a decoder model on one device"};
  app.set_version_flag("--version", odyssey::VersionLine("odyssey-train"));
  app.add_option("--model", o.model,
                 absl::StrCat("named shape (", absl::StrJoin(odyssey::model::NamedShapeNames(), ", "),
                              ") or HF checkpoint dir"))
      ->capture_default_str();
  app.add_option("--device", o.device, "auto | cpu | cuda | cuda:N")->capture_default_str();
  app.add_option("--dtype", o.dtype, "auto | float32 | bfloat16")->capture_default_str();
  app.add_option("--attention", o.attention, "auto | math | sdpa")->capture_default_str();
  app.add_option("--indexer-stage", o.indexer_stage,
                 "hybrid models with DSA layers: dense_warmup | sparse replaces the config's indexer stage (empty = the model's)");
  app.add_option("--steps", o.steps, "training steps")->capture_default_str();
  app.add_option("--lr", o.optimizer.lr, "peak learning rate")->capture_default_str();
  app.add_option("--weight-decay", o.optimizer.weight_decay, "AdamW weight decay")->capture_default_str();
  app.add_option("--warmup", o.schedule.warmup_steps, "linear warmup steps")->capture_default_str();
  app.add_option("--grad-clip", o.grad_clip, "max global grad norm (<= 0: off)")->capture_default_str();
  app.add_option("--data", o.data.format, "kjv | text | bin | jsonl")->capture_default_str();
  app.add_option("--data-path", o.data.path, "dataset file (text, bin, jsonl)");
  app.add_option("--seq-len", o.data.seq_len, "positions per row")->capture_default_str();
  app.add_option("--batch-size", o.data.batch_size, "rows per step")->capture_default_str();
  app.add_option("--seed", o.seed, "init and sampling seed")->capture_default_str();
  app.add_option("--lora-rank", o.lora.rank, "train LoRA adapters of this rank on a frozen base (0: full)")
      ->capture_default_str();
  app.add_option("--lora-alpha", o.lora.alpha, "LoRA alpha (0: the rank)")->capture_default_str();
  app.add_option("--lora-targets", o.lora.target_modules, "projections with adapters (default: all seven)");
  app.add_option("--out", out_dir, "write a checkpoint (HF dir + optimizer state) here at the end");
  app.add_option("--resume", resume, "resume from a checkpoint written by --out");
  app.add_option("--log-every", log_every, "print progress every N steps")->capture_default_str();
  app.add_option("--threads", threads, "CPU threads for torch (0: torch's default)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (threads > 0) torch::set_num_threads(threads);

  auto trainer = odyssey::engine::Trainer::Create(o);
  if (!trainer.ok()) {
    std::fprintf(stderr, "odyssey-train: %s\n", std::string(trainer.status().message()).c_str());
    return 2;
  }
  auto& t = **trainer;
  if (!resume.empty()) {
    if (absl::Status s = t.LoadCheckpoint(resume); !s.ok()) {
      std::fprintf(stderr, "odyssey-train: --resume: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  const auto& cfg = t.model()->config();
  odyssey::LogInfo(absl::StrFormat("model %s: %d layers, hidden %d, %.2fM params, %s on %s", o.model,
                                   cfg.num_hidden_layers, cfg.hidden_size,
                                   static_cast<double>(cfg.NumParameters()) / 1e6, c10::toString(t.dtype()),
                                   t.device().str()));
  odyssey::LogInfo(absl::StrCat("data: ", t.data().Describe()));
  double tokens = 0, seconds = 0;
  while (t.step() < o.steps) {
    auto r = t.TrainStep();
    tokens += static_cast<double>(r.tokens);
    seconds += r.seconds;
    if (!std::isfinite(r.loss)) {
      odyssey::LogError(absl::StrCat("step ", r.step, ": loss is ", r.loss, ", stopping"));
      return 1;
    }
    if (r.step % log_every == 0 || r.step == o.steps || r.step == 1) {
      std::printf("step %5lld/%lld  loss %.4f  grad_norm %.3f  lr %.2e  %.0f tok/s", static_cast<long long>(r.step),
                  static_cast<long long>(o.steps), r.loss, r.grad_norm, r.lr, r.tokens_per_second);
      if (t.model()->config().IsHybrid()) std::printf("  indexer_kl %.4f", r.indexer_loss);
      if (t.model()->config().moe.enabled()) std::printf("  moe_aux %.4f", r.aux_loss);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  odyssey::LogInfo(absl::StrFormat("trained %d steps, %.0f tokens in %.1f s (%.0f tok/s)", o.steps, tokens,
                                   seconds, seconds > 0 ? tokens / seconds : 0.0));
  if (!out_dir.empty()) {
    if (absl::Status s = t.SaveCheckpoint(out_dir); !s.ok()) {
      std::fprintf(stderr, "odyssey-train: --out: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    odyssey::LogInfo(absl::StrCat("checkpoint written to ", out_dir));
  }
  return 0;
}
