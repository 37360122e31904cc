// Trainer: one model, its optimizer and its data on one device; runs training steps.
//
// Data parallel (TrainerOptions::communicator with world_size > 1): every rank holds the whole
// model and optimizer, samples its own data (data seed + rank), and all-reduces its gradients
// before clipping, weighted so that the update equals one rank's step on the ranks' batches
// concatenated (the loss is the mean over all ranks' target tokens). Parameters are broadcast
// from rank 0 at creation, and every rank applies the same reduced gradients, so the ranks stay
// bitwise identical. Every rank must call Create and each step together.
//
// A step is forward + backward + clip + AdamW for one batch (one sequence or a packed batch),
// with the loss averaged over the batch's masked target tokens. Memory strategies plug in
// through set_layer_runner() (the decoder layers run through it). Checkpoints are
// Hugging Face directories (config.json + model.safetensors) plus optimizer.safetensors and
// trainer_state.json, so a checkpoint both loads in transformers and resumes exactly.
// Thread safety: one thread at a time.
#pragma once

#include <memory>
#include <string>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "engine/data.h"
#include "engine/memory/strategy.h"
#include "engine/optimizer.h"
#include "engine/parallel/communicator.h"
#include "model/causal_lm.h"

namespace odyssey::engine {

struct TrainerOptions {
  std::string model = "tiny";     // named shape or HF checkpoint directory
  int64_t num_layers = 0;         // > 0: cut a named shape to this many layers (benchmarks)
  std::string device = "auto";    // auto (cuda if present, else cpu) | cpu | cuda | cuda:N
  std::string dtype = "auto";     // auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16
  std::string attention = "auto"; // attention backend: auto | math | sdpa | cudnn
  int64_t attention_head_groups = 1;  // KV-head groups run one after another (divides KV heads)
  memory::MemoryOptions memory;   // recompute, offload, tiling (default: none of them)
  uint64_t seed = 0;              // model init (named shapes) and data sampling
  int64_t steps = 300;            // training steps (> 0)
  double grad_clip = 1.0;         // max global grad norm; <= 0 disables
  AdamWOptions optimizer;
  ScheduleOptions schedule;       // total_steps 0 = `steps`
  DataOptions data;               // vocab_size is taken from the model
  // Data parallel over the communicator's ranks when its world_size > 1; nullptr (or a world
  // of 1) trains alone. Not owned: it must outlive the trainer.
  Communicator* communicator = nullptr;
  absl::Status Validate() const;
};

struct StepResult {
  int64_t step = 0;          // steps completed after this one
  double loss = 0;           // mean over target tokens, nats
  double grad_norm = 0;      // before clipping
  double lr = 0;
  int64_t tokens = 0;        // positions processed (B * S), summed over the ranks
  int64_t target_tokens = 0; // positions in the loss, summed over the ranks
  double seconds = 0;
  double tokens_per_second = 0;
  // Not OK when a collective failed (data parallel): nothing was updated, and the ranks must
  // stop (the group is broken).
  absl::Status status;
};

class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const TrainerOptions& options);

  // One step on the next batch of the trainer's data source.
  StepResult TrainStep();
  // One step on a given batch (CPU tensors; moved to the device here).
  StepResult Step(const Batch& batch);
  // Mean loss of `batch` without updating anything.
  double EvalLoss(const Batch& batch);

  absl::Status SaveCheckpoint(const std::string& dir);
  // Loads weights, optimizer state and the step counter written by SaveCheckpoint.
  absl::Status LoadCheckpoint(const std::string& dir);

  void set_layer_runner(model::LayerStackRunner runner) { runner_ = std::move(runner); }
  memory::MemoryStack& memory() { return *memory_; }
  int64_t step() const { return optimizer_->steps(); }
  model::CausalLM& model() { return model_; }
  DataSource& data() { return *data_; }
  torch::Device device() const { return device_; }
  torch::Dtype dtype() const { return dtype_; }
  const TrainerOptions& options() const { return options_; }

 private:
  Trainer(TrainerOptions options, model::CausalLM model, std::unique_ptr<DataSource> data, torch::Device device,
          torch::Dtype dtype);
  torch::Tensor Loss(const Batch& batch, int64_t* targets);
  StepResult DataParallelStep(const Batch& batch);

  TrainerOptions options_;
  model::CausalLM model_;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<AdamW> optimizer_;
  std::vector<torch::Tensor> params_;
  torch::Device device_;
  torch::Dtype dtype_;
  model::LayerStackRunner runner_;
  std::unique_ptr<memory::MemoryStack> memory_;
};

// "auto" | "cpu" | "cuda" | "cuda:N"; errors name the field and rule.
absl::StatusOr<torch::Device> ParseDevice(const std::string& name);

}  // namespace odyssey::engine
